"""Paged attention: K/V live in blocks, reached through block tables.

The runner orders a step's tokens so that all single-token rows (decodes) come
first, then the multi-token rows (prefill chunks). Both kinds are attended in one
batched call each; on CPU by the C++ kernels (csrc/paged_attention.cpp for decodes,
csrc/prefill_attention.cpp for prefill chunks), which read K/V in place through the
block tables, cached prefix included. Elsewhere (CUDA, or no compiled kernels) each
row's blocks are gathered and SDPA attends to them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from pagedllm.model.ops import _C


@dataclass
class AttentionMetadata:
    """One step's attention layout, built once by the runner and shared by every layer."""
    slot_mapping: torch.Tensor          # [num_tokens] flat cache slot each new K/V goes to
    num_decode_tokens: int
    decode_block_tables: torch.Tensor   # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor       # [num_decodes] int64: keys each decode token attends to
    prefill_query_starts: torch.Tensor  # [chunks + 1] int64: chunk c is token rows [starts[c], starts[c + 1])
    prefill_context_lens: torch.Tensor  # [chunks] int64: the chunk's sequence's tokens cached before it
    prefill_block_tables: torch.Tensor  # [chunks, max_blocks] int64, covering context and chunk
    block_size: int
    use_kernel: bool                    # the C++ kernels serve

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
    ([head_dim, block_size]) so the kernels score many slots per vector instruction,
    values as rows ([block_size, head_dim]) so it accumulates many dimensions per instruction.
    """
    return ((num_blocks, num_kv_heads, head_dim, block_size),
            (num_blocks, num_kv_heads, block_size, head_dim))


def kernel_available(device: torch.device, head_dim: int) -> bool:
    """Whether the C++ kernels serve: built, on CPU, and a head size they vectorise."""
    return _C is not None and device.type == "cpu" and head_dim % 16 == 0 and head_dim <= 256


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores new K/V rows ([tokens, kv_heads, head_dim]) at their flat slots."""
    if _C is not None and k_cache.is_cpu and k.stride(-1) == 1 and v.stride(-1) == 1:
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


def _decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> None:
    if meta.use_kernel:   # q may be a view into qkv: the kernel reads it in place
        _C.paged_attention(out, q, k_cache, v_cache, meta.decode_block_tables,
                           meta.decode_rows, meta.decode_seq_lens, scale)
        return
    keys, values = _gather(k_cache, v_cache, meta.decode_block_tables)
    out.copy_(F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                             scale=scale, enable_gqa=True).squeeze(2))


def _prefill_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float) -> None:
    if meta.use_kernel:
        _C.prefill_attention(out, q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_starts,
                             meta.prefill_context_lens, scale)
        return
    starts = meta.prefill_query_starts.tolist()
    for chunk, context in enumerate(meta.prefill_context_lens.tolist()):
        start, end = starts[chunk], starts[chunk + 1]
        query = q[start:end].transpose(0, 1)
        mask = None
        if context == 0:   # the whole sequence is in this chunk: its own K/V suffice
            keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        else:
            length = context + end - start
            blocks = meta.prefill_block_tables[chunk, :-(-length // meta.block_size)]
            keys, values = (part[:, :length] for part in _gather(k_cache, v_cache, blocks))
            positions = torch.arange(context, length, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= positions[:, None]
        # A batch dimension of one: with it PyTorch's flash-attention kernel serves (GQA too).
        out[start:end] = F.scaled_dot_product_attention(
            query[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=True)[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] for the new tokens;
    caches laid out as kv_cache_shapes says. Rows past len(meta.slot_mapping) are padding.

    Writes the new K/V into the cache, then attends each token to its sequence's
    cached keys up to and including its own position. Returns [tokens, heads, head_dim],
    zeros in the padding rows.
    """
    num_tokens = meta.slot_mapping.shape[0]
    write_kv(k_cache, v_cache, k[:num_tokens], v[:num_tokens], meta.slot_mapping)
    num_decodes = meta.num_decode_tokens
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens < q.shape[0]:
        out[num_tokens:] = 0
    if num_decodes:
        _decode_attention(out[:num_decodes], q[:num_decodes], k_cache, v_cache, meta, scale)
    if num_decodes < num_tokens:
        _prefill_attention(out, q, k, v, k_cache, v_cache, meta, scale)
    return out
