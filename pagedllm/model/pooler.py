"""Pooling: one vector per sequence from its tokens' hidden states (vLLM's pooling runner), and the
embedding's finish (Matryoshka truncation, then L2 normalisation)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class Pooler:
    """Reduces each sequence of a step (whole prompts, laid out one after another) to one row."""

    def __init__(self, pooling_type: str):
        self.pooling_type = pooling_type

    def rows(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The step's token rows whose hidden states the pooling reads."""
        if self.pooling_type == "LAST":
            return starts + lengths - 1
        if self.pooling_type == "CLS":
            return starts
        return np.arange(int(lengths.sum()))

    def reduce(self, hidden: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
        """hidden: the rows `rows` chose, in their order -> [sequences, hidden] in float32."""
        hidden = hidden.float()
        if self.pooling_type != "MEAN":
            return hidden
        counts = torch.from_numpy(lengths).to(hidden.device)
        sequence = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), counts)
        sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, sequence, hidden)
        return sums / counts[:, None].to(hidden.dtype)


def finish_embedding(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation to the first `dimensions` values, then (if asked) unit L2 length: the order
    sentence-transformers' truncate_dim and Normalize module take."""
    if dimensions is not None:
        pooled = pooled[..., :dimensions]
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled
