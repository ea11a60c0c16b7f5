"""The layers whose tensor-parallel forms differ from one process's: row-parallel projections (their
partial sums all-reduced), the vocabulary-parallel embedding and the LM head (logits gathered on rank 0).

Column-parallel layers need no wrapper: a rank's Q/K/V and gate/up are ordinary layers over its rows
(tensor_parallel.py says which). With one rank, each helper returns the layer it was given.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.linear import Embedding


class RowParallelLinear(nn.Module):
    """A layer over this rank's input columns: its output is a partial sum, completed across ranks."""

    def __init__(self, layer: nn.Module, group: TensorParallelGroup):
        super().__init__()
        self.layer, self.group = layer, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.layer(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding: tokens outside them embed as zeros here, and the sum over
    ranks holds each token's row once."""

    def __init__(self, embedding: Embedding, group: TensorParallelGroup, vocab_size: int):
        super().__init__()
        self.embedding, self.group = embedding, group
        per_rank = vocab_size // group.world_size
        self.vocab_start, self.vocab_end = group.rank * per_rank, (group.rank + 1) * per_rank

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        outside = (token_ids < self.vocab_start) | (token_ids >= self.vocab_end)
        hidden = self.embedding((token_ids - self.vocab_start).masked_fill(outside, 0))
        return self.group.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """Logits for this rank's slice of the vocabulary, gathered into whole rows on rank 0 (None elsewhere)."""

    def __init__(self, layer: nn.Module, group: TensorParallelGroup):
        super().__init__()
        self.layer, self.group = layer, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.group.gather(self.layer(hidden), dim=-1)


def row_parallel(layer: nn.Module, group: TensorParallelGroup) -> nn.Module:
    return layer if group.world_size == 1 else RowParallelLinear(layer, group)


def vocab_parallel_embedding(embedding: Embedding, group: TensorParallelGroup, vocab_size: int) -> nn.Module:
    return embedding if group.world_size == 1 else VocabParallelEmbedding(embedding, group, vocab_size)


def parallel_lm_head(layer: nn.Module, group: TensorParallelGroup) -> nn.Module:
    return layer if group.world_size == 1 else ParallelLMHead(layer, group)
