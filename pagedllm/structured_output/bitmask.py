"""Applies a step's grammar bitmask to the logits rows that have a grammar, before sampling."""
from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, logits_rows: list[int]) -> torch.Tensor:
    """Sets to -inf, in logits rows logits_rows[i], every token bitmask[i] disallows; returns float32 logits
    (xgrammar's CPU kernel works on float32; the sampler turns logits into float32 anyway)."""
    logits = logits.float()
    rows = torch.tensor(logits_rows, dtype=torch.int64, device=logits.device)
    masked = logits.index_select(0, rows)
    xgr.apply_token_bitmask_inplace(masked, torch.from_numpy(bitmask).to(logits.device),
                                    vocab_size=logits.shape[1])
    logits.index_copy_(0, rows, masked)
    return logits
