"""The KV cache's layout: one layer's K or V blocks (and int8 scales), their shapes, and new K/V rounded or
quantized as the cache stores them.

The cache may hold K/V in a smaller dtype than the model's (`kv_cache_dtype`): bfloat16, float16, float8
e5m2, or int8 with a float32 scale per slot and kv head. Decode attention reads every cached K/V byte once
per step, so fewer bytes per token make it faster and let the same memory hold more tokens. New K/V are
rounded (or quantized) as they are written; the kernels widen the elements as they read them, and the
gathering path dequantizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheTensor:
    """One layer's K or V cache: its elements, laid out as kv_cache_shapes says, and for int8 their
    scales ([blocks, kv_heads, block_size] float32: an element's value is its int8 times its slot's
    scale; None for the other dtypes). The model hands it to the attention backend as it is."""
    data: torch.Tensor
    scales: torch.Tensor | None = None

    def copy_blocks(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copies whole blocks (copy on write), scales included."""
        for tensor in (self.data, self.scales):
            if tensor is not None:
                tensor.index_copy_(0, destinations, tensor.index_select(0, sources))


def has_scales(cache_dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype keeps a scale per slot and kv head (int8 does)."""
    return cache_dtype == torch.int8


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The K and V cache shapes of one layer.

    Each kv head's part of a block is contiguous; keys are stored transposed within it
    ([head_dim, block_size]) so the kernels score many slots per vector instruction,
    values as rows ([block_size, head_dim]) so it accumulates many dimensions per instruction.
    """
    return ((num_blocks, num_kv_heads, head_dim, block_size),
            (num_blocks, num_kv_heads, block_size, head_dim))


def kv_scales_shape(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
    """The shape of one layer's K (and V) scales, for caches that have them."""
    return num_blocks, num_kv_heads, block_size


def quantize(rows: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [..., head_dim] as a cache of cache_dtype stores them, and their scales [...] (None but
    for int8): rounded to nearest even, or for int8 symmetrically, scale = absmax / 127 and element =
    round(x / scale), ties to even (an all-zero row: zeros, scale 0). The formula of write_kv's kernel."""
    if not has_scales(cache_dtype):
        return rows.to(cache_dtype), None
    rows = rows.float()
    scales = rows.abs().amax(-1) / 127
    divisors = torch.where(scales > 0, scales, 1)
    return torch.round(rows / divisors[..., None]).clamp(-127, 127).to(cache_dtype), scales


def write_kv_reference(k_cache: CacheTensor, v_cache: CacheTensor, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Stores new K/V rows ([tokens, kv_heads, head_dim]) at their flat slots, in the cache's dtype, with
    PyTorch operations (any device)."""
    block_size = v_cache.data.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    (k_rows, k_scales), (v_rows, v_scales) = (quantize(rows, k_cache.data.dtype) for rows in (k, v))
    k_cache.data[blocks, :, :, offsets] = k_rows
    v_cache.data[blocks, :, offsets] = v_rows
    if k_scales is not None:
        k_cache.scales[blocks, :, offsets] = k_scales
        v_cache.scales[blocks, :, offsets] = v_scales


def gather(k_cache: CacheTensor, v_cache: CacheTensor, block_table: torch.Tensor, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., blocks] table -> keys and values in dtype as [..., kv_heads, blocks * block_size, head_dim]."""
    def as_rows(cache: CacheTensor, blocks: torch.Tensor) -> torch.Tensor:
        # blocks: [..., blocks, kv_heads, block_size, head_dim]; scales: [..., blocks, kv_heads, block_size]
        if cache.scales is not None:
            blocks = blocks.float() * cache.scales[block_table].unsqueeze(-1)
        return blocks.to(dtype).transpose(-4, -3).flatten(-3, -2)
    return (as_rows(k_cache, k_cache.data[block_table].transpose(-1, -2)),
            as_rows(v_cache, v_cache.data[block_table]))
