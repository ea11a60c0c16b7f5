"""Paged attention: K/V live in blocks, reached through block tables.

The runner orders a step's tokens so that all single-token rows (decodes) come
first; they are attended in one batched call: on CPU by the C++ kernel in
csrc/paged_attention.cpp, which reads K/V in place through the block tables, else
(CUDA, or no compiled kernel) by gathering each row's blocks and running SDPA.
Multi-token rows (prefill chunks) follow, one SDPA call each: there are few of
them per step, bounded by the token budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from pagedllm.model.ops import _C


@dataclass
class PrefillChunk:
    start: int                 # first row of this chunk in the flat token batch
    end: int
    context_len: int           # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks] physical ids covering context + chunk
    mask: torch.Tensor | None  # [chunk, context + chunk] bool, None when context_len == 0


@dataclass
class AttentionMetadata:
    """One step's attention layout, built once by the runner and shared by every layer."""
    slot_mapping: torch.Tensor          # [num_tokens] flat cache slot each new K/V goes to
    num_decode_tokens: int
    decode_block_tables: torch.Tensor   # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor       # [num_decodes] int64: keys each decode token attends to
    prefills: list[PrefillChunk]
    block_size: int
    use_kernel: bool                    # the C++ kernel serves the decodes

    @cached_property
    def decode_rows(self) -> torch.Tensor:
        return torch.arange(self.num_decode_tokens, device=self.decode_seq_lens.device)

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool: which gathered slots are real."""
        slots = self.decode_block_tables.shape[1] * self.block_size
        key_index = torch.arange(slots, device=self.decode_seq_lens.device)
        return (key_index[None, :] < self.decode_seq_lens[:, None])[:, None, None, :]


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The K and V cache shapes of one layer.

    Each kv head's part of a block is contiguous; keys are stored transposed within it
    ([head_dim, block_size]) so a decode kernel scores many slots per vector instruction,
    values as rows ([block_size, head_dim]) so it accumulates many dimensions per instruction.
    """
    return ((num_blocks, num_kv_heads, head_dim, block_size),
            (num_blocks, num_kv_heads, block_size, head_dim))


def kernel_available(device: torch.device, head_dim: int) -> bool:
    """Whether the C++ kernel serves decodes: built, on CPU, and a head size it vectorises."""
    return _C is not None and device.type == "cpu" and head_dim % 16 == 0 and head_dim <= 256


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores new K/V rows ([tokens, kv_heads, head_dim]) at their flat slots."""
    if _C is not None and k_cache.device.type == "cpu" and k.stride(-1) == 1 and v.stride(-1) == 1:
        _C.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    block_size = v_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, :, :, offsets] = k
    v_cache[blocks, :, offsets] = v


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., blocks] table -> keys and values as [..., kv_heads, blocks * block_size, head_dim]."""
    def as_rows(blocks: torch.Tensor) -> torch.Tensor:   # [..., blocks, kv_heads, block_size, head_dim]
        return blocks.transpose(-4, -3).flatten(-3, -2)
    return as_rows(k_cache[block_table].transpose(-1, -2)), as_rows(v_cache[block_table])


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if meta.use_kernel:   # q may be a view into qkv: the kernel reads it in place
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _C.paged_attention(out, q, k_cache, v_cache, meta.decode_block_tables,
                           meta.decode_rows, meta.decode_seq_lens, scale)
        return out
    keys, values = _gather(k_cache, v_cache, meta.decode_block_tables)
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                          scale=scale, enable_gqa=True).squeeze(2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] for the new tokens;
    caches laid out as kv_cache_shapes says.

    Writes the new K/V into the cache, then attends each token to its sequence's
    cached keys up to and including its own position. Returns [tokens, heads, head_dim].
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    num_decodes = meta.num_decode_tokens
    if not meta.prefills:
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if num_decodes:
        out[:num_decodes] = _decode_attention(q[:num_decodes], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        query = q[chunk.start:chunk.end].transpose(0, 1)
        if chunk.mask is None:
            keys = k[chunk.start:chunk.end].transpose(0, 1)
            values = v[chunk.start:chunk.end].transpose(0, 1)
        else:
            length = chunk.mask.shape[1]
            keys, values = (part[:, :length] for part in _gather(k_cache, v_cache, chunk.block_table))
        # A batch dimension of one: with it PyTorch's CPU flash-attention kernel serves (GQA
        # too); 3-D inputs take its unfused math path, 3-6x slower (measured, 384-2048 tokens).
        out[chunk.start:chunk.end] = F.scaled_dot_product_attention(
            query[None], keys[None], values[None], attn_mask=chunk.mask, is_causal=chunk.mask is None,
            scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return out
