"""Paged attention: K/V live in blocks, reached through block tables.

The runner orders a step's tokens so that all single-token rows (decodes) come
first, then the multi-token rows (prefill chunks). Both kinds are attended in one
batched call each; on CPU by the C++ kernels (csrc/paged_attention.cpp for decodes,
csrc/prefill_attention.cpp for prefill chunks), which read K/V in place through the
block tables, cached prefix included. Otherwise (the `torch` backend: no compiled kernels,
or chosen) each row's blocks are gathered and SDPA attends to them. On CUDA the `triton`
backend (triton_attention.py) serves instead; attention_backends.py chooses, once per engine.

The cache may hold K/V in a smaller dtype than the model's (`kv_cache_dtype`): bfloat16,
float16, float8 e5m2, or int8 with a float32 scale per slot and kv head. Decode attention
reads every cached K/V byte once per step, so fewer bytes per token make it faster and let
the same memory hold more tokens. New K/V are rounded (or quantized) as they are written;
the kernels widen the elements as they read them, and the gathering path dequantizes.

Where sequences share leading KV blocks (forks, beams, prefix-cache hits) the runner may hand a part
of the step (its decodes, its prefill chunks) over with SharedPrefixGroups (model/cascade.py): the C++
cascade kernel then reads each group's shared blocks once for all its query rows (not in sliding-window
layers, whose shared blocks may lie outside a token's window: those run the plain kernels).

A layer may attend within a sliding window (a token sees its last `window` keys, itself included: Mistral,
Gemma's local layers) and soft-cap its scores (Gemma 2: cap * tanh(score / cap) before the softmax).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm.model.cascade import SharedPrefixGroups
from pagedllm.model.ops import _C

if TYPE_CHECKING:   # attention_backends builds on this module
    from pagedllm.model.attention_backends import AttentionBackend


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
    # Every row at once, for a backend that attends decodes and prefill chunks in one launch (Triton); the
    # decode and prefill fields above are slices of these. The maxima are host integers: a launch grid
    # sized from them needs no read from the device.
    query_starts: torch.Tensor | None = None   # [rows + 1] int64: row r is tokens [starts[r], starts[r + 1])
    seq_lens: torch.Tensor | None = None       # [rows] int64: keys the row's last token attends to
    block_tables: torch.Tensor | None = None   # [rows, max_blocks] int64
    max_query_len: int = 0
    max_seq_len: int = 0
    backend: AttentionBackend | None = None   # the engine's, chosen once (attention_backends.py): the model calls it
    # Sequences sharing prefix blocks, among the decodes and among the prefill chunks (kernel only).
    decode_cascade: SharedPrefixGroups | None = None
    prefill_cascade: SharedPrefixGroups | None = None

    @cached_property
    def decode_rows(self) -> torch.Tensor:
        return torch.arange(self.num_decode_tokens, device=self.decode_seq_lens.device)

    @cached_property
    def decode_query_starts(self) -> torch.Tensor:
        """Decodes as chunks of one token each, as the cascade kernel takes sequences."""
        return torch.arange(self.num_decode_tokens + 1, device=self.decode_seq_lens.device)

    @cached_property
    def decode_context_lens(self) -> torch.Tensor:
        return self.decode_seq_lens - 1

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool: which gathered slots are real."""
        slots = self.decode_block_tables.shape[1] * self.block_size
        key_index = torch.arange(slots, device=self.decode_seq_lens.device)
        return (key_index[None, :] < self.decode_seq_lens[:, None])[:, None, None, :]


@dataclass(frozen=True)
class LayerAttention:
    """What differs between the attention of a model's layers besides the caches."""
    scale: float
    sliding_window: int | None = None   # None: every key before the token
    logit_softcap: float | None = None

    def kernel_limits(self) -> tuple[int, float]:
        """The kernels' sliding_window and logit_softcap arguments (0: none)."""
        return self.sliding_window or 0, self.logit_softcap or 0.0


@dataclass(frozen=True)
class CacheTensor:
    """One layer's K or V cache: its elements, laid out as kv_cache_shapes says, and for int8 their
    scales ([blocks, kv_heads, block_size] float32: an element's value is its int8 times its slot's
    scale; None for the other dtypes). The model hands it to paged_attention as it is."""
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


def kernel_available(device: torch.device, head_dim: int) -> bool:
    """Whether the C++ kernels serve: built, on CPU, and a head size they vectorise."""
    return _C is not None and device.type == "cpu" and head_dim % 16 == 0 and head_dim <= 256


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


def write_kv(k_cache: CacheTensor, v_cache: CacheTensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores new K/V rows ([tokens, kv_heads, head_dim]) at their flat slots, in the cache's dtype."""
    if _C is not None and k_cache.data.is_cpu and k.stride(-1) == 1 and v.stride(-1) == 1:
        _C.write_kv(k_cache.data, v_cache.data, k_cache.scales, v_cache.scales, k, v, slot_mapping)
        return
    block_size = v_cache.data.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    (k_rows, k_scales), (v_rows, v_scales) = (quantize(rows, k_cache.data.dtype) for rows in (k, v))
    k_cache.data[blocks, :, :, offsets] = k_rows
    v_cache.data[blocks, :, offsets] = v_rows
    if k_scales is not None:
        k_cache.scales[blocks, :, offsets] = k_scales
        v_cache.scales[blocks, :, offsets] = v_scales


def _gather(k_cache: CacheTensor, v_cache: CacheTensor, block_table: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., blocks] table -> keys and values in dtype as [..., kv_heads, blocks * block_size, head_dim]."""
    def as_rows(cache: CacheTensor, blocks: torch.Tensor) -> torch.Tensor:
        # blocks: [..., blocks, kv_heads, block_size, head_dim]; scales: [..., blocks, kv_heads, block_size]
        if cache.scales is not None:
            blocks = blocks.float() * cache.scales[block_table].unsqueeze(-1)
        return blocks.to(dtype).transpose(-4, -3).flatten(-3, -2)
    return (as_rows(k_cache, k_cache.data[block_table].transpose(-1, -2)),
            as_rows(v_cache, v_cache.data[block_table]))


def _cascade_attention(out: torch.Tensor, q: torch.Tensor, k_cache: CacheTensor, v_cache: CacheTensor,
                       block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                       groups: SharedPrefixGroups, layer: LayerAttention) -> None:
    _C.cascade_attention(out, q, k_cache.data, v_cache.data, k_cache.scales, v_cache.scales, block_tables,
                         query_starts, context_lens, groups.group_seqs, groups.group_starts, groups.shared_lens,
                         layer.scale, layer.kernel_limits()[1])


def _reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                         layer: LayerAttention) -> torch.Tensor:
    """SDPA, or with soft-capping (which SDPA cannot do) the same in plain operations.
    q: [..., heads, queries, head_dim]; keys, values: [..., kv_heads, keys, head_dim]; visible: a bool mask
    broadcasting to [..., queries, keys] (None: causal over the last queries)."""
    if layer.logit_softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, is_causal=visible is None,
                                              scale=layer.scale, enable_gqa=True)
    group = q.shape[-3] // keys.shape[-3]
    keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = (q @ keys.transpose(-1, -2)) * layer.scale
    scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
    if visible is None:
        num_queries, num_keys = scores.shape[-2:]
        visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(num_keys - num_queries)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values


def _decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: CacheTensor, v_cache: CacheTensor,
                      meta: AttentionMetadata, layer: LayerAttention) -> None:
    if meta.decode_cascade is not None and layer.sliding_window is None:
        _cascade_attention(out, q, k_cache, v_cache, meta.decode_block_tables, meta.decode_query_starts,
                           meta.decode_context_lens, meta.decode_cascade, layer)
        return
    if meta.use_kernel:   # q may be a view into qkv: the kernel reads it in place
        _C.paged_attention(out, q, k_cache.data, v_cache.data, k_cache.scales, v_cache.scales,
                           meta.decode_block_tables, meta.decode_rows, meta.decode_seq_lens, layer.scale,
                           *layer.kernel_limits())
        return
    keys, values = _gather(k_cache, v_cache, meta.decode_block_tables, q.dtype)
    visible = meta.decode_mask
    if layer.sliding_window is not None:
        key_index = torch.arange(visible.shape[-1], device=q.device)
        visible = visible & (key_index >= (meta.decode_seq_lens - layer.sliding_window)[:, None, None, None])
    out.copy_(_reference_attention(q.unsqueeze(2), keys, values, visible, layer).squeeze(2))


def _prefill_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: CacheTensor, v_cache: CacheTensor, meta: AttentionMetadata,
                       layer: LayerAttention) -> None:
    if meta.prefill_cascade is not None and layer.sliding_window is None:
        _cascade_attention(out, q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_starts,
                           meta.prefill_context_lens, meta.prefill_cascade, layer)
        return
    if meta.use_kernel:
        _C.prefill_attention(out, q, k_cache.data, v_cache.data, k_cache.scales, v_cache.scales,
                             meta.prefill_block_tables, meta.prefill_query_starts, meta.prefill_context_lens,
                             layer.scale, *layer.kernel_limits())
        return
    exact_cache = k_cache.data.dtype == k.dtype   # the cache holds the new K/V as they are
    starts = meta.prefill_query_starts.tolist()
    for chunk, context in enumerate(meta.prefill_context_lens.tolist()):
        start, end = starts[chunk], starts[chunk + 1]
        query = q[start:end].transpose(0, 1)
        length = context + end - start
        whole_sequence = context == 0 and exact_cache   # all in this chunk: its own K/V suffice
        if whole_sequence:
            keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        else:
            blocks = meta.prefill_block_tables[chunk, :-(-length // meta.block_size)]
            keys, values = (part[:, :length] for part in _gather(k_cache, v_cache, blocks, q.dtype))
        visible = None   # causal
        if not whole_sequence or layer.sliding_window is not None:
            positions = torch.arange(context, length, device=q.device)[:, None]
            key_index = torch.arange(length, device=q.device)[None, :]
            visible = key_index <= positions
            if layer.sliding_window is not None:
                visible &= key_index > positions - layer.sliding_window
        # A batch dimension of one: with it PyTorch's flash-attention kernel serves (GQA too).
        out[start:end] = _reference_attention(query[None], keys[None], values[None], visible,
                                              layer)[0].transpose(0, 1)


# Labels of the attention ranges torch.profiler reports (`pagedllm bench throughput --profile-attention`).
DECODE_RANGE, PREFILL_RANGE = "pagedllm::decode_attention", "pagedllm::prefill_attention"


def _profiled(name: str):
    """A labelled range while a profiler runs; nothing otherwise (a record_function costs microseconds)."""
    return torch.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled \
        else contextlib.nullcontext()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: CacheTensor,
                    v_cache: CacheTensor, meta: AttentionMetadata, layer: LayerAttention) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] for the new tokens;
    one layer's caches (CacheTensor). Rows past len(meta.slot_mapping) are padding.

    Writes the new K/V into the cache, then attends each token to its sequence's
    cached keys up to and including its own position (within the layer's window). Returns
    [tokens, heads, head_dim], zeros in the padding rows.
    """
    num_tokens = meta.slot_mapping.shape[0]
    write_kv(k_cache, v_cache, k[:num_tokens], v[:num_tokens], meta.slot_mapping)
    num_decodes = meta.num_decode_tokens
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens < q.shape[0]:
        out[num_tokens:] = 0
    if num_decodes:
        with _profiled(DECODE_RANGE):
            _decode_attention(out[:num_decodes], q[:num_decodes], k_cache, v_cache, meta, layer)
    if num_decodes < num_tokens:
        with _profiled(PREFILL_RANGE):
            _prefill_attention(out, q, k, v, k_cache, v_cache, meta, layer)
    return out
