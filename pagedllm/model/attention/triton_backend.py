"""The `triton` attention backend: the KV write and one unified attention launch per layer (triton_kernels.py)."""
from __future__ import annotations

import torch

from pagedllm.model.attention import triton_kernels
from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.attention.metadata import AttentionBackend, AttentionMetadata, LayerAttention


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device, head_dim: int, block_size: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype, layers: tuple[LayerAttention, ...] = ()):
        """Refuses, once, what the kernels cannot take: the layout, sliding windows or soft-capping (not
        written for Triton yet), or a CPU without the interpreter."""
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"attention_backend 'triton' runs on cuda (or cpu under TRITON_INTERPRET=1), got {device}")
        if device.type == "cpu" and not triton_kernels.INTERPRETED:
            raise ValueError("attention_backend 'triton' on cpu runs only under Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before pagedllm is imported (or use attention_backend 'cpu')")
        if device.type == "cuda" and triton_kernels.INTERPRETED:
            raise ValueError("attention_backend 'triton' on cuda: TRITON_INTERPRET=1 is set, which would run the "
                             "kernels on the host; unset it")
        triton_kernels.check_layout(head_dim, block_size, dtype, cache_dtype)
        windowed = [index for index, layer in enumerate(layers) if layer.sliding_window is not None]
        capped = [index for index, layer in enumerate(layers) if layer.logit_softcap is not None]
        unsupported = ([f"sliding-window attention (layers {windowed})"] if windowed else []) + (
            [f"attention logit soft-capping (layers {capped})"] if capped else [])
        if unsupported:
            raise ValueError(f"attention_backend 'triton' cannot run this model's {' and '.join(unsupported)} yet; "
                             "use attention_backend 'torch' (any device) or 'cpu'")

    def write_kv(self, k_cache: CacheTensor, v_cache: CacheTensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        triton_kernels.write_kv(k_cache.data, v_cache.data, k_cache.scales, v_cache.scales, k, v, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: CacheTensor,
                v_cache: CacheTensor, meta: AttentionMetadata, layer: LayerAttention) -> torch.Tensor:
        num_tokens = meta.slot_mapping.shape[0]
        self.write_kv(k_cache, v_cache, k[:num_tokens], v[:num_tokens], meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_tokens < q.shape[0]:
            out[num_tokens:] = 0
        triton_kernels.unified_attention(out, q, k_cache.data, v_cache.data, k_cache.scales, v_cache.scales,
                                         meta.block_tables, meta.query_starts, meta.seq_lens, meta.max_query_len,
                                         meta.max_seq_len, layer.scale)
        return out
