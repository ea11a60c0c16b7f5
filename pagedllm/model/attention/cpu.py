"""The `cpu` attention backend: the C++ kernels (csrc/paged_attention.cpp for decodes,
csrc/prefill_attention.cpp for prefill chunks, csrc/cascade_attention.cpp for sequences sharing prefix
blocks), which read K/V in place through the block tables, cached prefix included, in every cache dtype.

Groups of sequences that share leading blocks go to the cascade kernel, which reads each group's shared
blocks once for all its query rows; not in sliding-window layers, whose shared blocks may lie outside a
token's window: those run the plain kernels. The other prefill chunks take the path prefill_path.py chose
(the register tile kernel, or its brgemm twin; on AVX2 brgemm for steps with a long enough chunk).
"""
from __future__ import annotations

import torch

from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.attention.metadata import AttentionMetadata, LayerAttention
from pagedllm.model.attention.paged import DecodePrefillBackend
from pagedllm.model.attention.prefill_path import choose_prefill_path
from pagedllm.model.cascade import SharedPrefixGroups
from pagedllm.model.kernels import kernel_for


def head_dim_fits(head_dim: int) -> bool:
    """Whether the kernels vectorise this head size."""
    return head_dim % 16 == 0 and head_dim <= 256


class CpuAttentionBackend(DecodePrefillBackend):
    name = "cpu"
    uses_cpu_kernels = True

    def __init__(self, dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None):
        """Takes the kernels of the variant model/kernels.py chose for this CPU (selector.py checked they are built),
        the prefill path for a model of dtype over a cache of cache_dtype (default: dtype)."""
        cpu = torch.device("cpu")
        self.prefill_path = choose_prefill_path(dtype, cache_dtype or dtype)
        self._write_kv, self._paged_attention, self._cascade_attention = (
            kernel_for(op, cpu) for op in ("write_kv", "paged_attention", "cascade_attention"))
        self._prefill_kernels = {op: kernel_for(op, cpu) for op in self.prefill_path.ops}

    def describe(self) -> str:
        return f"{self.name} (prefill: {self.prefill_path.describe()})"

    def write_kv(self, k_cache: CacheTensor, v_cache: CacheTensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self._write_kv(k_cache.data, v_cache.data, k_cache.scales, v_cache.scales, k, v, slot_mapping)

    def _cascade(self, out: torch.Tensor, q: torch.Tensor, k_cache: CacheTensor, v_cache: CacheTensor,
                 block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                 groups: SharedPrefixGroups, layer: LayerAttention) -> None:
        self._cascade_attention(out, q, k_cache.data, v_cache.data, k_cache.scales, v_cache.scales, block_tables,
                                query_starts, context_lens, groups.group_seqs, groups.group_starts, groups.shared_lens,
                                layer.scale, layer.kernel_limits()[1])

    def decode(self, out, q, k_cache, v_cache, meta: AttentionMetadata, layer: LayerAttention) -> None:
        if meta.decode_cascade is not None and layer.sliding_window is None:
            self._cascade(out, q, k_cache, v_cache, meta.decode_block_tables, meta.decode_query_starts,
                          meta.decode_context_lens, meta.decode_cascade, layer)
            return
        # q may be a view into qkv: the kernel reads it in place
        self._paged_attention(out, q, k_cache.data, v_cache.data, k_cache.scales, v_cache.scales,
                              meta.decode_block_tables, meta.decode_rows, meta.decode_seq_lens, layer.scale,
                              *layer.kernel_limits())

    def prefill(self, out, q, k, v, k_cache, v_cache, meta: AttentionMetadata, layer: LayerAttention) -> None:
        if meta.prefill_cascade is not None and layer.sliding_window is None:
            self._cascade(out, q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_starts,
                          meta.prefill_context_lens, meta.prefill_cascade, layer)
            return
        kernel = self._prefill_kernels[self.prefill_path.op_for(meta.max_query_len)]
        kernel(out, q, k_cache.data, v_cache.data, k_cache.scales, v_cache.scales, meta.prefill_block_tables,
               meta.prefill_query_starts, meta.prefill_context_lens, layer.scale, *layer.kernel_limits())
