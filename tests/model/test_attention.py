"""The C++ paged-attention kernels against the PyTorch path and a dense reference, for every KV cache dtype."""
import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.attention import cache as cache_layout
from pagedllm.model.attention.cache import CacheTensor, write_kv_reference
from pagedllm.model.attention.cpu import CpuAttentionBackend
from pagedllm.model.attention.metadata import AttentionMetadata, LayerAttention
from pagedllm.model.attention.torch_reference import TorchAttentionBackend
from pagedllm.model.kernels import kernels as _C
from tests.attention_reference import (DTYPE_PAIRS, caches_of, causal_reference, dequantize, noise_cache,
                                       reference_quantize, tolerance)

pytestmark = pytest.mark.kernels

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2, torch.int8]


def layouts(block_sizes):
    """(dtype, cache_dtype, block_size): every block size over a cache in the model dtype; over the others
    8 and 24, which between them take the whole-vector and the partial-vector paths of each read."""
    return [(dtype, cache_dtype, block_size) for dtype, cache_dtype in DTYPE_PAIRS for block_size in block_sizes
            if dtype == cache_dtype or block_size in (8, 24)]


def scattered_cache(seq_lens, block_size, kv_heads, head_dim, dtype, generator, cache_dtype=None):
    """Dense K/V per sequence (in dtype), the same written slot by slot, as the reference quantizes them,
    into shuffled physical blocks of the documented cache layout (of cache_dtype, default dtype), the
    block tables, and the dense K/V as the cache holds them (dequantized, float32)."""
    cache_dtype = cache_dtype or dtype
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    order = torch.randperm(num_blocks, generator=generator)
    tables = order[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).contiguous()
    k_shape, v_shape = cache_layout.kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    scales_shape = cache_layout.kv_scales_shape(num_blocks, block_size, kv_heads)
    k_cache, v_cache = (noise_cache(shape, scales_shape, cache_dtype, generator) for shape in (k_shape, v_shape))
    keys = [torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype) for n in seq_lens]
    held_keys, held_values = [], []
    for i, n in enumerate(seq_lens):
        (k, k_scales), (v, v_scales) = (reference_quantize(rows[i], cache_dtype) for rows in (keys, values))
        for t in range(n):
            block, offset = tables[i, t // block_size], t % block_size
            k_cache.data[block, :, :, offset] = k[t]
            v_cache.data[block, :, offset, :] = v[t]
            if k_scales is not None:
                k_cache.scales[block, :, offset] = k_scales[t]
                v_cache.scales[block, :, offset] = v_scales[t]
        held_keys.append(dequantize(k, k_scales))
        held_values.append(dequantize(v, v_scales))
    return k_cache, v_cache, tables, held_keys, held_values


@pytest.mark.parametrize("dtype,cache_dtype,block_size", layouts([8, 16, 24, 64]))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (20, 2, 128)])
def test_kernel_matches_dense_attention(dtype, cache_dtype, block_size, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(0)
    seq_lens = [1, 5, 16, 17, 100, 333]
    k_cache, v_cache, tables, keys, values = scattered_cache(seq_lens, block_size, kv_heads, head_dim, dtype,
                                                             generator, cache_dtype)
    # q as the model passes it: the first columns of each token's qkv row
    qkv = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, :heads * head_dim].view(len(seq_lens), heads, head_dim)
    lens = torch.tensor(seq_lens)
    out = torch.empty(q.shape, dtype=dtype)
    _C.paged_attention(out, q, *caches_of(k_cache, v_cache), tables, torch.arange(len(seq_lens)), lens,
                                 0.125)
    for i in range(len(seq_lens)):
        expected = F.scaled_dot_product_attention(
            q[i].float().unsqueeze(1), keys[i].transpose(0, 1), values[i].transpose(0, 1),
            scale=0.125, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(out[i].float(), expected, **tolerance(dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e5m2])
def test_kernel_widens_every_float16_and_fp8_value_exactly(cache_dtype):
    """One-key sequences: each probability is exactly 1, so the output is the cached value itself, widened.
    Every bit pattern of the dtype is cached (subnormals, infinities and NaNs included)."""
    bits = torch.arange(2 ** (8 * cache_dtype.itemsize), dtype=torch.int32)
    every_value = (bits.to(torch.int16) if cache_dtype == torch.float16 else bits.to(torch.uint8)).view(cache_dtype)
    head_dim = 256
    num_seqs = every_value.numel() // head_dim
    v_cache = torch.zeros(num_seqs, 1, 8, head_dim, dtype=cache_dtype)   # a block per sequence, its key in slot 0
    v_cache[:, 0, 0] = every_value.view(num_seqs, head_dim)
    k_cache = torch.zeros(num_seqs, 1, head_dim, 8, dtype=cache_dtype)
    out = torch.empty(num_seqs, 1, head_dim)
    _C.paged_attention(out, torch.ones(num_seqs, 1, head_dim), k_cache, v_cache, None, None,
                                 torch.arange(num_seqs)[:, None], torch.arange(num_seqs),
                                 torch.ones(num_seqs, dtype=torch.int64), 1.0)
    torch.testing.assert_close(out.flatten(), every_value.float(), atol=0, rtol=0, equal_nan=True)


# How a layer attends: plainly, within a sliding window (of a block and a half, shorter than most sequences
# here), soft-capped (Gemma 2's 50 on scores of size ~10: tanh bends them), or both.
LAYERS = [LayerAttention(32 ** -0.5), LayerAttention(32 ** -0.5, sliding_window=24),
          LayerAttention(32 ** -0.5, logit_softcap=5.0), LayerAttention(32 ** -0.5, sliding_window=7, logit_softcap=5.0)]


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_kernel_and_pytorch_paths_agree_inside_paged_attention(cache_dtype, layer):
    generator = torch.Generator().manual_seed(1)
    # two decodes, then a 17-token chunk after a cached prefix of 60 tokens and a whole 20-token prompt
    seq_lens, new_tokens = [3, 40, 77, 20], [1, 1, 17, 20]
    k_cache, v_cache, tables, _, _ = scattered_cache(seq_lens, 16, 2, 32, torch.float32, generator, cache_dtype)
    positions = torch.cat([torch.arange(n - new, n) for n, new in zip(seq_lens, new_tokens)])
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(new_tokens))
    slots = tables[rows, positions // 16] * 16 + positions % 16
    num_rows = len(rows) + 3   # three rows of batch padding, which must write and attend nothing
    q = torch.randn(num_rows, 4, 32, generator=generator)
    k_new = torch.randn(num_rows, 2, 32, generator=generator)
    v_new = torch.randn(num_rows, 2, 32, generator=generator)
    results, caches = [], []
    for backend in (CpuAttentionBackend(torch.float32, cache_dtype), TorchAttentionBackend()):
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=2, decode_block_tables=tables[:2],
                                 decode_seq_lens=torch.tensor(seq_lens[:2]), prefill_query_starts=torch.tensor([2, 19, 39]),
                                 prefill_context_lens=torch.tensor([60, 0]), prefill_block_tables=tables[2:],
                                 block_size=16)
        caches.append(tuple(CacheTensor(c.data.clone(), None if c.scales is None else c.scales.clone())
                            for c in (k_cache, v_cache)))
        results.append(backend.forward(q, k_new, v_new, *caches[-1], meta, layer))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    assert not results[0][-3:].any()
    written = torch.zeros(k_cache.data.shape[0] * 16, dtype=torch.bool)
    written[slots] = True
    by_slot = (lambda k: k.permute(0, 3, 1, 2), lambda v: v.permute(0, 2, 1, 3))   # [blocks, slots, heads, dim]
    for view, cache, original in zip(by_slot, caches[0], (k_cache, v_cache)):   # only the real tokens' slots changed
        bits = (lambda c: view(c.data).view(torch.uint8)) if cache_dtype.itemsize == 1 else (lambda c: view(c.data))
        changed = (bits(cache) != bits(original)).flatten(2).any(-1).flatten()
        assert torch.equal(changed, written)


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
def test_write_kv_stores_what_the_reference_quantization_gives(dtype, cache_dtype):
    generator = torch.Generator().manual_seed(2)
    k_shape, v_shape = cache_layout.kv_cache_shapes(6, 16, 3, 64)
    scales_shape = cache_layout.kv_scales_shape(6, 16, 3)
    slots = torch.tensor([0, 17, 95, 40, 63])
    kv = torch.randn(5, 2 * 3 * 64 + 8, generator=generator).to(dtype) * 3
    kv[3, 64:128] = 0   # one all-zero row (token 3, kv head 1 of K)
    k, v = kv[:, :192].view(5, 3, 64), kv[:, 192:384].view(5, 3, 64)   # strided rows
    caches = []
    for write_kv in (CpuAttentionBackend().write_kv, write_kv_reference):
        k_cache, v_cache = (CacheTensor(torch.zeros(shape, dtype=cache_dtype),
                                        torch.zeros(scales_shape) if cache_dtype == torch.int8 else None)
                            for shape in (k_shape, v_shape))
        write_kv(k_cache, v_cache, k, v, slots)
        caches.append((k_cache, v_cache))
    as_bits = (lambda t: t.view(torch.uint8)) if cache_dtype.itemsize == 1 else (lambda t: t)
    for kernel_cache, indexed_cache in zip(*caches):
        assert torch.equal(as_bits(kernel_cache.data), as_bits(indexed_cache.data))
        if cache_dtype == torch.int8:
            assert torch.equal(kernel_cache.scales, indexed_cache.scales)
    k_cache, v_cache = caches[0]
    blocks, offsets = slots // 16, slots % 16
    for rows, cache, stored in ((k, k_cache, k_cache.data[blocks, :, :, offsets]),
                                (v, v_cache, v_cache.data[blocks, :, offsets])):
        expected, expected_scales = reference_quantize(rows, cache_dtype)
        assert torch.equal(as_bits(stored), as_bits(expected))
        if cache_dtype == torch.int8:
            assert torch.equal(cache.scales[blocks, :, offsets], expected_scales)
    if cache_dtype == torch.int8:
        assert k_cache.scales[2, 1, 8] == 0 and not k_cache.data[2, 1, :, 8].any()   # slot 40: the zero row
        assert k_cache.data.abs().max() == 127   # each row's largest element takes the whole range


@pytest.mark.parametrize("dtype,cache_dtype,block_size", layouts([8, 16, 24, 64, 128]))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (20, 2, 128)])
def test_prefill_kernel_matches_dense_causal_attention(dtype, cache_dtype, block_size, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(3)
    # (context already cached, chunk length): whole prompts, chunks after a cached prefix,
    # lengths around block edges, an odd last key, a single-token chunk, and 700 keys (more than
    # one 512-key tile: the running maximum and sum are rescaled between tiles)
    chunks = [(0, 1), (0, 17), (0, 130), (16, 5), (37, 64), (100, 1), (5, 250), (300, 400)]
    seq_lens = [context + length for context, length in chunks]
    k_cache, v_cache, tables, keys, values = scattered_cache(seq_lens, block_size, kv_heads, head_dim, dtype,
                                                             generator, cache_dtype)
    num_tokens = sum(length for _, length in chunks)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)   # strided, as the model passes it
    starts = torch.tensor([0] + [length for _, length in chunks]).cumsum(0)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    scale = head_dim ** -0.5
    _C.prefill_attention(out, q, *caches_of(k_cache, v_cache), tables, starts,
                                   torch.tensor([context for context, _ in chunks]), scale)
    for i, (context, length) in enumerate(chunks):
        rows = slice(starts[i], starts[i + 1])
        expected = causal_reference(q[rows], keys[i], values[i], context, scale)
        torch.testing.assert_close(out[rows].float(), expected, **tolerance(dtype))


def test_kernels_refuse_int8_caches_without_scales_and_scales_elsewhere():
    k_cache = torch.zeros(2, 1, 32, 8, dtype=torch.int8)
    v_cache = torch.zeros(2, 1, 8, 32, dtype=torch.int8)
    k, slots = torch.zeros(1, 1, 32), torch.tensor([0])
    with pytest.raises(RuntimeError, match="int8 caches take scales, the other dtypes none"):
        _C.write_kv(k_cache, v_cache, None, None, k, k, slots)
    scales = torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="int8 caches take scales, the other dtypes none"):
        _C.write_kv(k_cache.float(), v_cache.float(), scales, scales, k, k, slots)


@pytest.mark.parametrize("v_shape", [(2, 1, 32, 8), (3, 1, 8, 32), (2, 2, 8, 32), (2, 1, 8, 16), (2, 8, 32)])
def test_kernels_refuse_a_v_cache_that_is_not_the_k_cache_transposed(v_shape):
    """K is [blocks, kv_heads, head_dim, block_size], V [blocks, kv_heads, block_size, head_dim]: V laid out as K,
    or differing in blocks, kv heads, block size or rank, is refused by name."""
    k_cache, k, slots = torch.zeros(2, 1, 32, 8), torch.zeros(1, 1, 32), torch.tensor([0])
    with pytest.raises(RuntimeError, match="write_kv: K and V caches must match"):
        _C.write_kv(k_cache, torch.zeros(v_shape), None, None, k, k, slots)
    _C.write_kv(k_cache, torch.zeros(2, 1, 8, 32), None, None, k, k, slots)   # the layout that matches


@pytest.mark.parametrize("dtype,cache_dtype,block_size", layouts([8, 16, 24]))
@pytest.mark.parametrize("sliding_window,softcap", [(1, None), (7, None), (40, None), (None, 5.0), (13, 5.0)])
def test_kernels_attend_within_the_window_and_cap_scores(dtype, cache_dtype, block_size, sliding_window, softcap):
    """Decode and prefill kernels against the dense reference, windows of one key, shorter than a block, and
    longer than several, each sequence's blocks before its window left as noise (as released blocks are)."""
    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, head_dim = 9, 3, 64
    chunks = [(0, 1), (0, 17), (0, 130), (16, 5), (37, 64), (100, 1), (5, 250), (300, 400)]
    seq_lens = [context + length for context, length in chunks]
    k_cache, v_cache, tables, keys, values = scattered_cache(seq_lens, block_size, kv_heads, head_dim, dtype,
                                                             generator, cache_dtype)
    if sliding_window is not None:   # what lies wholly before every query's window is never read
        for i, (context, _) in enumerate(chunks):
            for block in tables[i, :max(0, context - sliding_window + 1) // block_size]:
                for cache in (k_cache, v_cache):
                    (cache.data if cache.scales is None else cache.scales)[block] = float("nan")
    num_tokens = sum(length for _, length in chunks)
    q = torch.randn(num_tokens, heads, head_dim, generator=generator).mul(2).to(dtype)
    starts = torch.tensor([0] + [length for _, length in chunks]).cumsum(0)
    scale = head_dim ** -0.5
    limits = (sliding_window or 0, softcap or 0.0)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    _C.prefill_attention(out, q, *caches_of(k_cache, v_cache), tables, starts,
                                   torch.tensor([context for context, _ in chunks]), scale, *limits)
    last = starts[1:] - 1   # each sequence's last token, as a decode
    decoded = torch.empty(len(chunks), heads, head_dim, dtype=dtype)
    _C.paged_attention(decoded, q[last].contiguous(), *caches_of(k_cache, v_cache), tables,
                                 torch.arange(len(chunks)), torch.tensor(seq_lens), scale, *limits)
    for i, (context, length) in enumerate(chunks):
        rows = slice(starts[i], starts[i + 1])
        expected = causal_reference(q[rows], keys[i], values[i], context, scale, sliding_window, softcap)
        torch.testing.assert_close(out[rows].float(), expected, **tolerance(dtype))
        torch.testing.assert_close(decoded[i].float(), expected[-1], **tolerance(dtype))
