"""Packed token bitmasks applied to logits rows in place: a grammar's allowed next tokens (structured outputs)
and a request's allowed_token_ids share this one form and this one pass.

The layout is xgrammar's: int32 words, bit b of word w is token 32w + b, 1 where the token is allowed. On
CPU a kernel masks only the named rows, skipping words that allow everything (a profile of 64 rows under a
JSON schema: xgrammar's own CPU mask took 6 ms of the step, the kernel about 1); elsewhere torch unpacks
the bits.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from pagedllm.model.kernels import kernel_for

_CPU_KERNEL = kernel_for("apply_token_bitmask", torch.device("cpu"))


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def pack_allowed(token_ids: np.ndarray) -> np.ndarray:
    """The words of a bitmask that allows exactly token_ids, up to the word of the largest one (int32): the
    words after it, up to a vocabulary's, are zero (`stack_bitmasks` adds them)."""
    bits = np.zeros(bitmask_words(int(token_ids.max()) + 1) * 32, np.uint8)
    bits[token_ids] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def stack_bitmasks(packed: list[np.ndarray], vocab_size: int) -> np.ndarray:
    """[len(packed), bitmask_words(vocab_size)] int32 of pack_allowed's rows."""
    stacked = np.zeros((len(packed), bitmask_words(vocab_size)), np.int32)
    for row, words in enumerate(packed):
        stacked[row, :len(words)] = words
    return stacked


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray | torch.Tensor, logits_rows: torch.Tensor) -> None:
    """Sets to -inf, in float32 logits row logits_rows[i] (int64), every token bitmask[i] disallows."""
    bitmask = torch.as_tensor(bitmask)
    if logits.is_cpu and _CPU_KERNEL is not None:
        _CPU_KERNEL(logits, bitmask.contiguous(), logits_rows.cpu())
    else:
        apply_token_bitmask_torch(logits, bitmask, logits_rows)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, logits_rows: torch.Tensor) -> None:
    """apply_token_bitmask with torch ops, on any device (the bits unpacked to a [rows, vocab] mask)."""
    bitmask, logits_rows = bitmask.to(logits.device), logits_rows.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :logits.shape[1]].bool()
    logits[logits_rows] = logits[logits_rows].masked_fill(~allowed, -math.inf)
