"""Triton kernels for CUDA: paged attention and the KV write, reading the cache layout in place.

They take the caches exactly as `cache.kv_cache_shapes` lays them out (K [blocks, kv_heads, head_dim,
block_size], V [blocks, kv_heads, block_size, head_dim], int8 with a float32 scale per slot and kv head),
so the C++ CPU kernels, these and the PyTorch reference share one cache.

`unified_attention` attends every row of a step in one launch, decodes and prefill chunks alike: a
program takes one sequence's tile of query tokens times the query heads of one kv head (GQA rows packed
into one matrix, so a kv head's keys are read once for its whole group), walks the sequence's block
table and keeps a running softmax (flash attention). Long decode contexts are split over several
programs along the keys (split-KV), whose partial results a second kernel merges. The launch settings
come from an explicit table keyed by shape (`launch_config`): `@triton.autotune` would need a GPU driver
even under the interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, that is when this module is first imported:
with TRITON_INTERPRET=1 set before then, the kernels run on CPU tensors (slowly), which is how the tests
check them against the PyTorch reference on a machine without a GPU. `INTERPRETED` says which it was.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Cache element types the kernels read and write (fp8 is left to the other backends).
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
# 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude below 2**22 to the nearest
# integer, ties to even, as torch.round does (the int8 quantization formula of cache.quantize).
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                     kc_stride_b, kc_stride_h, kc_stride_d, kc_stride_s,
                     vc_stride_b, vc_stride_h, vc_stride_s, vc_stride_d,
                     sc_stride_b, sc_stride_h,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     QUANTIZE: tl.constexpr, BFLOAT16_BITS: tl.constexpr):
    """One program per (token, kv head): its K and V rows into the token's slot."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM_PAD)
    inside = dims < HEAD_DIM
    k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + dims, mask=inside, other=0.0)
    v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + dims, mask=inside, other=0.0)
    k_dest = k_cache_ptr + block * kc_stride_b + head * kc_stride_h + dims * kc_stride_d + offset * kc_stride_s
    v_dest = v_cache_ptr + block * vc_stride_b + head * vc_stride_h + offset * vc_stride_s + dims * vc_stride_d
    if QUANTIZE:
        scale_offset = block * sc_stride_b + head * sc_stride_h + offset
        k, k_scale = _quantize_row(k.to(tl.float32))
        v, v_scale = _quantize_row(v.to(tl.float32))
        tl.store(k_scales_ptr + scale_offset, k_scale)
        tl.store(v_scales_ptr + scale_offset, v_scale)
    if BFLOAT16_BITS:
        k, v = _bfloat16_bits(k.to(tl.float32)), _bfloat16_bits(v.to(tl.float32))
    tl.store(k_dest, k.to(k_cache_ptr.dtype.element_ty), mask=inside)
    tl.store(v_dest, v.to(v_cache_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _bfloat16_bits(x):
    """The bits of x rounded to bfloat16, to nearest even, as torch rounds (Triton 3.9's interpreter
    truncates a float32 cast to bfloat16; the GPU rounds: this gives the one result on both)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)


@triton.jit
def _quantize_row(x):
    """scale = absmax / 127, element = round(x / scale) ties to even (0 and scale 0 for a zero row)."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), 0), 127.0)
    divisor = tl.where(scale > 0, scale, 1.0)
    rounded = (tl.math.div_rn(x, divisor) + _ROUND_MAGIC) - _ROUND_MAGIC
    return tl.minimum(tl.maximum(rounded, -127.0), 127.0), scale


@triton.jit
def _dot(a, b, WIDEN: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with b's elements first taken to a's dtype (the reference reads the cache in the model dtype),
    accumulated in float32. WIDEN: both operands widened (exactly) to float32 before the product, for
    Triton 3.9's interpreter, whose bfloat16 dot returns garbage; the products and sums are the same."""
    b = b.to(tl.float32).to(a.dtype)   # through float32: exact, and the interpreter's int8 -> bfloat16 is broken
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attention_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                      block_tables_ptr, query_starts_ptr, seq_lens_ptr,
                      partial_acc_ptr, partial_max_ptr, partial_sum_ptr,
                      scale,
                      q_stride_t, q_stride_h, out_stride_t, out_stride_h, bt_stride,
                      kc_stride_b, kc_stride_h, kc_stride_d, kc_stride_s,
                      vc_stride_b, vc_stride_h, vc_stride_s, vc_stride_d,
                      sc_stride_b, sc_stride_h,
                      NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEY_TILE: tl.constexpr,
                      BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SCALES: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """Program (sequence, query tile, kv head * NUM_SPLITS + split).

    Rows of the tile are (token, head in the group) pairs: row r is token r // GROUP of the tile and
    query head kv_head * GROUP + r % GROUP. Keys are visited KEY_TILE at a time, each found through the
    block table; a key at position n is seen by a token at position p when n <= p (its sequence's cached
    context plus the chunk so far). With NUM_SPLITS > 1 the program covers one share of the key tiles and leaves its unscaled
    sum, running maximum and softmax denominator for _merge_splits_kernel.
    """
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    tokens_per_tile: tl.constexpr = BLOCK_M // GROUP
    query_start = tl.load(query_starts_ptr + seq).to(tl.int32)
    query_len = tl.load(query_starts_ptr + seq + 1).to(tl.int32) - query_start
    if tile * tokens_per_tile >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    token_in_seq = tile * tokens_per_tile + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < tokens_per_tile * GROUP) & (token_in_seq < query_len)
    token = (query_start + token_in_seq).to(tl.int64)
    row_position = context_len + token_in_seq          # the key position each row attends up to
    dims = tl.arange(0, HEAD_DIM_PAD)
    dims_valid = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                mask=row_valid[:, None] & dims_valid[None, :], other=0.0)

    # Keys this tile can see: up to its last token's position; then this split's share of their key tiles.
    last_key = tl.minimum(seq_len, context_len + (tile + 1) * tokens_per_tile)
    num_key_tiles = tl.cdiv(last_key, KEY_TILE)
    tiles_per_split = tl.cdiv(num_key_tiles, NUM_SPLITS)
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(num_key_tiles, first_tile + tiles_per_split)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634   # scores in base 2: exp2 is the cheap exponential
    for key_tile in range(first_tile, end_tile):
        # A tile of keys may span several cache blocks (block_size < KEY_TILE): each key finds its own.
        positions = key_tile * KEY_TILE + tl.arange(0, KEY_TILE)
        in_sequence = positions < seq_len
        block = tl.load(block_tables_ptr + seq * bt_stride + positions // BLOCK_SIZE, mask=in_sequence,
                        other=0).to(tl.int64)
        slot = positions % BLOCK_SIZE
        k = tl.load(k_cache_ptr + block[None, :] * kc_stride_b + kv_head * kc_stride_h
                    + dims[:, None] * kc_stride_d + slot[None, :] * kc_stride_s,
                    mask=dims_valid[:, None] & in_sequence[None, :], other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * vc_stride_b + kv_head * vc_stride_h
                    + slot[:, None] * vc_stride_s + dims[None, :] * vc_stride_d,
                    mask=in_sequence[:, None] & dims_valid[None, :], other=0.0)
        scores = _dot(q, k, WIDEN_DOTS, DOT_PRECISION)
        if HAS_SCALES:
            scale_offset = block * sc_stride_b + kv_head * sc_stride_h + slot
            scores = scores * tl.load(k_scales_ptr + scale_offset, mask=in_sequence, other=0.0)[None, :]
        visible = (positions[None, :] <= row_position[:, None]) & row_valid[:, None]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)   # rows that see nothing yet stay at zero
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        if HAS_SCALES:
            probs = probs * tl.load(v_scales_ptr + scale_offset, mask=in_sequence, other=0.0)[None, :]
        acc = acc * rescale[:, None] + _dot(probs.to(q.dtype), v, WIDEN_DOTS, DOT_PRECISION)
        running_max = new_max

    if NUM_SPLITS == 1:
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dims_valid[None, :])
    else:
        partial = (token * NUM_HEADS + head) * NUM_SPLITS + split   # [tokens, heads, splits]
        tl.store(partial_max_ptr + partial, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial, running_sum, mask=row_valid)
        tl.store(partial_acc_ptr + partial[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, out_stride_t, out_stride_h,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    """Program (token, head): the splits' partial softmaxes, rescaled to their common maximum, summed."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    partial = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    maxima = tl.load(partial_max_ptr + partial)
    overall = tl.max(maxima, 0)
    weights = tl.where(maxima == float("-inf"), 0.0, tl.exp2(maxima - overall))   # an empty split adds nothing
    total = tl.sum(tl.load(partial_sum_ptr + partial) * weights, 0)
    acc = tl.sum(tl.load(partial_acc_ptr + partial[:, None] * HEAD_DIM_PAD + dims[None, :]) * weights[:, None], 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * out_stride_t + head * out_stride_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


INTERPRETED = isinstance(_attention_kernel, InterpretedFunction)


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int      # query rows (tokens x heads of a group) per program
    key_tile: int     # keys per step of a program's loop
    num_splits: int   # programs per (sequence, kv head) along the keys; 1: no split
    num_warps: int


# Decodes whose longest context reaches this many keys are split along the keys, so that a small batch
# still gives the GPU enough programs; each split covers at least SPLIT_MIN_KEYS keys.
SPLIT_MIN_KEYS = 512
MAX_SPLITS = 16
TARGET_PROGRAMS = 132   # about the streaming multiprocessors of a large GPU: the programs to fill it


def launch_config(num_seqs: int, max_query_len: int, max_seq_len: int, num_kv_heads: int, group: int,
                  block_size: int) -> LaunchConfig:
    """The table of launch settings by shape. Decode-only steps (one query token per sequence) with
    long contexts and too few (sequence, kv head) programs to fill the GPU split the keys; everything
    else runs one program per (sequence, tile of query rows, kv head). A key tile is at least 16 keys
    (tl.dot's shortest inner dimension for 16-bit types), spanning several blocks where they are smaller."""
    block_m = 16 if max_query_len == 1 else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    key_tile = max(16, block_size)
    num_splits = 1
    programs = num_seqs * num_kv_heads
    if max_query_len == 1 and max_seq_len >= 2 * SPLIT_MIN_KEYS and programs < TARGET_PROGRAMS:
        by_length = max_seq_len // SPLIT_MIN_KEYS
        by_occupancy = -(-TARGET_PROGRAMS // programs)
        wanted = min(MAX_SPLITS, by_length, by_occupancy)
        num_splits = 1 << (wanted.bit_length() - 1)   # a power of two (the merge kernel's tl.arange), <= wanted
    return LaunchConfig(block_m, key_tile, num_splits, num_warps=4)


def check_layout(head_dim: int, block_size: int, model_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Raises ValueError naming what the kernels cannot take; the backend calls it once, at start-up."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention backend takes head_dim 1..{MAX_HEAD_DIM}, got {head_dim}")
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"the Triton attention backend takes a block_size that is a power of two >= 8, "
                         f"got {block_size}")
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"the Triton attention backend takes dtype float32, bfloat16 or float16, got {model_dtype}")
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"the Triton attention backend takes kv_cache_dtype auto, bfloat16, float16 or int8, "
                         f"got {str(cache_dtype).removeprefix('torch.')}")


def _check_rows(name: str, tensor: torch.Tensor) -> None:
    """The kernels index rows by their strides but assume each row's last dimension is contiguous."""
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(tensor.stride())}")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
             v_scales: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores K/V rows [tokens, kv_heads, head_dim] at their flat slots (int8: quantized, with scales)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if not num_tokens:
        return
    _check_rows("k", k)
    _check_rows("v", v)
    quantize = k_cache.dtype == torch.int8
    if quantize != (k_scales is not None):
        raise ValueError("int8 caches take scales, the other dtypes none")
    scales_strides = k_scales.stride()[:2] if quantize else (0, 0)
    bfloat16_bits = k_cache.dtype == torch.bfloat16   # written as their bits, rounded by _bfloat16_bits
    if bfloat16_bits:
        k_cache, v_cache = k_cache.view(torch.uint16), v_cache.view(torch.uint16)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, slot_mapping, k_cache, v_cache, k_scales, v_scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride(), *v_cache.stride(), *scales_strides,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=v_cache.shape[2],
        QUANTIZE=quantize, BFLOAT16_BITS=bfloat16_bits)


def unified_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k_scales: torch.Tensor | None, v_scales: torch.Tensor | None, block_tables: torch.Tensor,
                      query_starts: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int,
                      scale: float, config: LaunchConfig | None = None) -> None:
    """out[t] = softmax(q[t] K^T * scale) V over the keys of t's sequence up to t's own position.

    q, out: [tokens, heads, head_dim]; sequence s owns query rows [query_starts[s], query_starts[s+1]) and
    has seq_lens[s] keys in the cache (its new ones written already), reached through block_tables[s].
    max_query_len and max_seq_len are host integers (the launch grid is sized without reading the GPU).
    Rows no sequence owns are left untouched. config: launch settings other than the table's (tests).
    """
    num_seqs = seq_lens.shape[0]
    if not num_seqs:
        return
    _check_rows("q", q)
    _check_rows("out", out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[3]
    group = num_heads // num_kv_heads
    config = config or launch_config(num_seqs, max_query_len, max_seq_len, num_kv_heads, group, block_size)
    tokens_per_tile = config.block_m // group
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))   # tl.dot's shortest inner dimension
    partial_acc = partial_max = partial_sum = None
    if config.num_splits > 1:
        shape = (q.shape[0], num_heads, config.num_splits)
        partial_acc = torch.empty(*shape, head_dim_pad, dtype=torch.float32, device=q.device)
        partial_max = torch.empty(shape, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty(shape, dtype=torch.float32, device=q.device)
    has_scales = k_scales is not None
    grid = (num_seqs, -(-max_query_len // tokens_per_tile), num_kv_heads * config.num_splits)
    _attention_kernel[grid](
        out, q, k_cache, v_cache, k_scales, v_scales, block_tables, query_starts, seq_lens,
        partial_acc, partial_max, partial_sum, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.stride(), *v_cache.stride(), *(k_scales.stride()[:2] if has_scales else (0, 0)),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        KEY_TILE=config.key_tile, BLOCK_M=config.block_m, NUM_SPLITS=config.num_splits, HAS_SCALES=has_scales,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN_DOTS=INTERPRETED and q.dtype == torch.bfloat16, num_warps=config.num_warps)
    if config.num_splits > 1:
        if max_query_len != 1:
            raise ValueError(f"split-KV serves decode-only steps, got max_query_len {max_query_len}")
        # Every sequence owns one row: rows 0..num_seqs-1.
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, partial_acc, partial_max, partial_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=config.num_splits)
