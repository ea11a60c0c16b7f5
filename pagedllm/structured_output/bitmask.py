"""Applies a step's grammar bitmask to the logits rows that have a grammar, before sampling."""
from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, logits_rows: list[int]) -> torch.Tensor:
    """Sets to -inf, in logits rows logits_rows[i], every token bitmask[i] disallows; returns float32 logits
    (xgrammar's CPU kernel works on float32; the sampler turns logits into float32 anyway).

    xgrammar masks only the rows it is given (`indices`) of a bitmask aligned with the logits: cheaper
    than gathering the rows out and back (measured: 9 against 56 ms for 32 of 64 rows on a busy 2-core
    EPYC)."""
    logits = logits.float()
    num_rows = logits.shape[0]
    if logits_rows == list(range(num_rows)):
        aligned, indices = bitmask, None
    else:
        aligned = np.full((num_rows, bitmask.shape[1]), -1, np.int32)
        aligned[logits_rows] = bitmask
        indices = logits_rows
    xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(aligned).to(logits.device),
                                    vocab_size=logits.shape[1], indices=indices)
    return logits
