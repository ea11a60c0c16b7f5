"""The C++ paged-attention kernel against the PyTorch path and a dense reference."""
import pytest
import torch
import torch.nn.functional as F

from pagedllm.model import attention
from pagedllm.model.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(attention._C is None, reason="C++ kernel not built")


def scattered_cache(seq_lens, block_size, kv_heads, head_dim, dtype, generator):
    """Dense K/V per sequence, the same written slot by slot into shuffled physical blocks
    of the documented cache layout, and the block tables."""
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    order = torch.randperm(num_blocks, generator=generator)
    tables = order[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).contiguous()
    k_shape, v_shape = attention.kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(k_shape, generator=generator).to(dtype)   # unwritten slots hold noise
    v_cache = torch.randn(v_shape, generator=generator).to(dtype)
    keys = [torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype) for n in seq_lens]
    for i, n in enumerate(seq_lens):
        for t in range(n):
            block, offset = tables[i, t // block_size], t % block_size
            k_cache[block, :, :, offset] = keys[i][t]
            v_cache[block, :, offset, :] = values[i][t]
    return k_cache, v_cache, tables, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 24, 64])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (20, 2, 128)])
def test_kernel_matches_dense_attention(dtype, block_size, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(0)
    seq_lens = [1, 5, 16, 17, 100, 333]
    k_cache, v_cache, tables, keys, values = scattered_cache(seq_lens, block_size, kv_heads, head_dim, dtype,
                                                             generator)
    # q as the model passes it: the first columns of each token's qkv row
    qkv = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, :heads * head_dim].view(len(seq_lens), heads, head_dim)
    lens = torch.tensor(seq_lens)
    out = torch.empty(q.shape, dtype=dtype)
    attention._C.paged_attention(out, q, k_cache, v_cache, tables, torch.arange(len(seq_lens)), lens, 0.125)
    for i in range(len(seq_lens)):
        expected = F.scaled_dot_product_attention(
            q[i].float().unsqueeze(1), keys[i].float().transpose(0, 1), values[i].float().transpose(0, 1),
            scale=0.125, enable_gqa=True).squeeze(1)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].float(), expected, atol=tolerance, rtol=tolerance)


def test_kernel_and_pytorch_paths_agree_inside_paged_attention():
    generator = torch.Generator().manual_seed(1)
    # two decodes, then a 17-token chunk after a cached prefix of 60 tokens and a whole 20-token prompt
    seq_lens, new_tokens = [3, 40, 77, 20], [1, 1, 17, 20]
    k_cache, v_cache, tables, _, _ = scattered_cache(seq_lens, 16, 2, 32, torch.float32, generator)
    positions = torch.cat([torch.arange(n - new, n) for n, new in zip(seq_lens, new_tokens)])
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(new_tokens))
    slots = tables[rows, positions // 16] * 16 + positions % 16
    num_rows = len(rows) + 3   # three rows of batch padding, which must write and attend nothing
    q = torch.randn(num_rows, 4, 32, generator=generator)
    k_new = torch.randn(num_rows, 2, 32, generator=generator)
    v_new = torch.randn(num_rows, 2, 32, generator=generator)
    results, caches = [], []
    for use_kernel in (True, False):
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=2, decode_block_tables=tables[:2],
                                 decode_seq_lens=torch.tensor(seq_lens[:2]), prefill_query_starts=torch.tensor([2, 19, 39]),
                                 prefill_context_lens=torch.tensor([60, 0]), prefill_block_tables=tables[2:],
                                 block_size=16, use_kernel=use_kernel)
        caches.append((k_cache.clone(), v_cache.clone()))
        results.append(paged_attention(q, k_new, v_new, *caches[-1], meta, 32 ** -0.5))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    assert not results[0][-3:].any()
    written = torch.zeros(k_cache.shape[0] * 16, dtype=torch.bool)
    written[slots] = True
    by_slot = (lambda k: k.permute(0, 3, 1, 2), lambda v: v.permute(0, 2, 1, 3))   # [blocks, slots, heads, dim]
    for view, cache, original in zip(by_slot, caches[0], (k_cache, v_cache)):   # only the real tokens' slots changed
        changed = (view(cache) != view(original)).flatten(2).any(-1).flatten()
        assert torch.equal(changed, written)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_kernel_matches_indexing(dtype):
    generator = torch.Generator().manual_seed(2)
    k_shape, v_shape = attention.kv_cache_shapes(6, 16, 3, 64)
    slots = torch.tensor([0, 17, 95, 40, 63])
    kv = torch.randn(5, 2 * 3 * 64 + 8, generator=generator).to(dtype)
    k, v = kv[:, :192].view(5, 3, 64), kv[:, 192:384].view(5, 3, 64)   # strided rows
    caches = []
    for kernel in (attention._C, None):
        k_cache, v_cache = torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)
        original, attention._C = attention._C, kernel
        try:
            attention.write_kv(k_cache, v_cache, k, v, slots)
        finally:
            attention._C = original
        caches.append((k_cache, v_cache))
    for kernel_cache, indexed_cache in zip(*caches):
        assert torch.equal(kernel_cache, indexed_cache)
    k_cache, v_cache = caches[1]
    assert torch.equal(k_cache[5, :, :, 15], k[2]) and torch.equal(v_cache[1, :, 1], v[1])   # slot 95, slot 17


def causal_reference(q, keys, values, context_len, scale):
    """q: [chunk, heads, head_dim] at positions context_len..; keys/values: [context + chunk, kv_heads, head_dim]."""
    positions = torch.arange(context_len, context_len + q.shape[0])
    mask = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), keys.float().transpose(0, 1),
                                          values.float().transpose(0, 1), attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 24, 64, 128])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (20, 2, 128)])
def test_prefill_kernel_matches_dense_causal_attention(dtype, block_size, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(3)
    # (context already cached, chunk length): whole prompts, chunks after a cached prefix,
    # lengths around block edges, an odd last key, a single-token chunk, and 700 keys (more than
    # one 512-key tile: the running maximum and sum are rescaled between tiles)
    chunks = [(0, 1), (0, 17), (0, 130), (16, 5), (37, 64), (100, 1), (5, 250), (300, 400)]
    seq_lens = [context + length for context, length in chunks]
    k_cache, v_cache, tables, keys, values = scattered_cache(seq_lens, block_size, kv_heads, head_dim, dtype,
                                                             generator)
    num_tokens = sum(length for _, length in chunks)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)   # strided, as the model passes it
    starts = torch.tensor([0] + [length for _, length in chunks]).cumsum(0)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    scale = head_dim ** -0.5
    attention._C.prefill_attention(out, q, k_cache, v_cache, tables, starts,
                                   torch.tensor([context for context, _ in chunks]), scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (context, length) in enumerate(chunks):
        rows = slice(starts[i], starts[i + 1])
        expected = causal_reference(q[rows], keys[i], values[i], context, scale)
        torch.testing.assert_close(out[rows].float(), expected, atol=tolerance, rtol=tolerance)
