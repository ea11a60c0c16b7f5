"""What the cpu and torch backends share: the new K/V written, then the decodes attended in one batched
call and the prefill chunks in another, each in a range torch.profiler can report."""
from __future__ import annotations

import contextlib
from abc import abstractmethod

import torch

from pagedllm.model.attention import DECODE_RANGE, PREFILL_RANGE
from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.attention.metadata import AttentionBackend, AttentionMetadata, LayerAttention


def _profiled(name: str):
    """A labelled range while a profiler runs; nothing otherwise (a record_function costs microseconds)."""
    return torch.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled \
        else contextlib.nullcontext()


class DecodePrefillBackend(AttentionBackend):
    """A backend that attends a step's decodes (one token each, first) apart from its prefill chunks."""

    @abstractmethod
    def decode(self, out: torch.Tensor, q: torch.Tensor, k_cache: CacheTensor, v_cache: CacheTensor,
               meta: AttentionMetadata, layer: LayerAttention) -> None:
        """Fills out [num_decodes, heads, head_dim] from the decodes' q."""

    @abstractmethod
    def prefill(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: CacheTensor,
                v_cache: CacheTensor, meta: AttentionMetadata, layer: LayerAttention) -> None:
        """Fills the prefill chunks' rows of out (all the step's rows given, the decode rows first)."""

    def forward(self, q, k, v, k_cache, v_cache, meta, layer):
        num_tokens = meta.slot_mapping.shape[0]
        self.write_kv(k_cache, v_cache, k[:num_tokens], v[:num_tokens], meta.slot_mapping)
        num_decodes = meta.num_decode_tokens
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_tokens < q.shape[0]:
            out[num_tokens:] = 0
        if num_decodes:
            with _profiled(DECODE_RANGE):
                self.decode(out[:num_decodes], q[:num_decodes], k_cache, v_cache, meta, layer)
        if num_decodes < num_tokens:
            with _profiled(PREFILL_RANGE):
                self.prefill(out, q, k, v, k_cache, v_cache, meta, layer)
        return out
