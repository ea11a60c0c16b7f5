"""The cascade (shared-prefix) kernel against the plain paged kernels and dense SDPA, and the search for
shared prefixes in block tables against hand-counted groups."""
import numpy as np
import pytest
import torch

from pagedllm.model.attention import cache as cache_layout
from pagedllm.model.kernels import kernels as _C
from pagedllm.model.cascade import ALWAYS, CascadeRule, SharedPrefixGroups, find_shared_prefixes
from tests.attention_reference import (DTYPE_PAIRS, caches_of, causal_reference, dequantize, noise_cache,
                                       reference_quantize, tolerance)

pytestmark = pytest.mark.kernels


def shared_cache(groups, block_size, kv_heads, head_dim, dtype, cache_dtype, generator):
    """groups: [(common_blocks, [(context, rows), ...])]: each group's members hold the same physical
    blocks, with the same keys, for their first common_blocks blocks (a fork, beams, a prefix-cache hit),
    then blocks of their own. Returns the caches, block tables (shuffled physical blocks, rows padded
    with other sequences' ids) and each sequence's keys and values as the cache holds them."""
    lengths = [[context + rows for context, rows in members] for _, members in groups]
    needed = sum(common + sum(max(0, -(-n // block_size) - common) for n in group)
                 for (common, _), group in zip(groups, lengths))
    num_blocks = needed + 3
    free = torch.randperm(num_blocks, generator=generator).tolist()
    k_shape, v_shape = cache_layout.kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    scales_shape = cache_layout.kv_scales_shape(num_blocks, block_size, kv_heads)
    k_cache, v_cache = (noise_cache(shape, scales_shape, cache_dtype, generator) for shape in (k_shape, v_shape))
    tables, held_keys, held_values = [], [], []
    for (common, _), group in zip(groups, lengths):
        common_ids = [free.pop() for _ in range(common)]
        common_keys = torch.randn(common * block_size, kv_heads, head_dim, generator=generator).to(dtype)
        common_values = torch.randn(common * block_size, kv_heads, head_dim, generator=generator).to(dtype)
        for n in group:
            table = common_ids + [free.pop() for _ in range(max(0, -(-n // block_size) - common))]
            own = max(0, n - common * block_size)
            keys = torch.cat([common_keys, torch.randn(own, kv_heads, head_dim, generator=generator).to(dtype)])[:n]
            values = torch.cat([common_values, torch.randn(own, kv_heads, head_dim, generator=generator).to(dtype)])[:n]
            (k, k_scales), (v, v_scales) = (reference_quantize(rows, cache_dtype) for rows in (keys, values))
            for t in range(n):
                block, offset = table[t // block_size], t % block_size
                k_cache.data[block, :, :, offset] = k[t]
                v_cache.data[block, :, offset, :] = v[t]
                if k_scales is not None:
                    k_cache.scales[block, :, offset] = k_scales[t]
                    v_cache.scales[block, :, offset] = v_scales[t]
            tables.append(table)
            held_keys.append(dequantize(k, k_scales))
            held_values.append(dequantize(v, v_scales))
    width = max(len(t) for t in tables) + 1
    padded = [t + [free[0] if free else 0] * (width - len(t)) for t in tables]
    return k_cache, v_cache, torch.tensor(padded), held_keys, held_values


def run_both(groups, block_size, heads, kv_heads, head_dim, dtype=torch.float32, cache_dtype=torch.float32,
             seed=0, min_shared_tokens=1):
    """Builds the sequences, finds their shared prefixes, and attends with the cascade kernel and with the
    plain kernel (prefill_attention, or paged_attention where every sequence is a decode). Returns both
    outputs, the queries, the dense references and the groups found."""
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, keys, values = shared_cache(groups, block_size, kv_heads, head_dim, dtype,
                                                          cache_dtype, generator)
    shapes = [shape for _, members in groups for shape in members]
    contexts = torch.tensor([context for context, _ in shapes])
    rows = torch.tensor([n for _, n in shapes])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), rows.cumsum(0)])
    num_tokens = int(starts[-1])
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)   # strided, as the model passes it
    scale = head_dim ** -0.5
    found = find_shared_prefixes(tables.numpy(), contexts.numpy(), block_size,
                                 CascadeRule(((2, min_shared_tokens),)))
    if found is None:   # one sequence alone: the search makes no group of one, the kernel takes it
        (common, [(context, _)]), = groups
        found = SharedPrefixGroups(torch.tensor([0]), torch.tensor([0, 1]),
                                   torch.tensor([min(common * block_size, context)]))
    cascade = torch.full(q.shape, float("nan"), dtype=dtype)
    _C.cascade_attention(cascade, q, *caches_of(k_cache, v_cache), tables, starts, contexts,
                                   found.group_seqs, found.group_starts, found.shared_lens, scale)
    plain = torch.full(q.shape, float("nan"), dtype=dtype)
    if (rows == 1).all():
        _C.paged_attention(plain, q, *caches_of(k_cache, v_cache), tables, torch.arange(len(shapes)),
                                     contexts + 1, scale)
    else:
        _C.prefill_attention(plain, q, *caches_of(k_cache, v_cache), tables, starts, contexts, scale)
    references = [causal_reference(q[starts[i]:starts[i + 1]], keys[i], values[i], int(contexts[i]), scale)
                  for i in range(len(shapes))]
    return cascade, plain, torch.cat(references), found


def assert_matches(groups, block_size, heads=9, kv_heads=3, head_dim=64, dtype=torch.float32,
                   cache_dtype=torch.float32, **kwargs):
    cascade, plain, dense, found = run_both(groups, block_size, heads, kv_heads, head_dim, dtype, cache_dtype,
                                            **kwargs)
    torch.testing.assert_close(cascade.float(), dense, **tolerance(dtype))
    torch.testing.assert_close(cascade.float(), plain.float(), **tolerance(dtype))
    return found


def decodes(contexts):
    return [(context, 1) for context in contexts]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("members", [1, 2, 40], ids=["group-of-1", "group-of-2", "group-of-40"])
def test_decodes_sharing_whole_blocks(block_size, heads, kv_heads, head_dim, members):
    """Members' contexts end past the shared blocks: the prefix ends on a block boundary."""
    common = 96 // block_size + 1
    contexts = [common * block_size + 3 * i + 1 for i in range(members)]
    found = assert_matches([(common, decodes(contexts))], block_size, heads, kv_heads, head_dim)
    if members > 1:
        assert found.shared_lens.tolist() == [common * block_size]


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decodes_sharing_a_prefix_that_ends_mid_block(block_size):
    """The tables agree on one block more than the shortest context covers: the prefix ends mid-block,
    at that context, and the other members read the rest of that block in their own pass."""
    common = 4
    shortest = 3 * block_size + 5
    contexts = [shortest, shortest + 1, 4 * block_size - 1, 6 * block_size + 2]
    found = assert_matches([(common, decodes(contexts))], block_size)
    assert found.shared_lens.tolist() == [shortest]


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch_of_groups_and_lone_sequences(block_size):
    """Two groups, sequences that share nothing, and a pair that shares one block only (left to the plain
    pass by the size threshold)."""
    groups = [(5, decodes([5 * block_size + 1, 5 * block_size + 9, 7 * block_size])),
              (0, decodes([30])), (0, decodes([3 * block_size + 2])),
              (8, decodes([8 * block_size + 4, 9 * block_size + 1])),
              (1, decodes([block_size + 2, block_size + 7]))]
    found = assert_matches(groups, block_size, min_shared_tokens=2 * block_size)
    sizes = found.group_starts.diff().tolist()
    assert sorted(zip(sizes, found.shared_lens.tolist())) == [(2, 8 * block_size), (3, 5 * block_size)]


def test_forks_and_beams():
    """A beam-search-like tree: 4 beams share a prompt's 6 blocks; two of them share 2 more blocks
    (the search takes the prefix common to the whole group: 6 blocks); a fork of 3 parallel samples
    shares 3 whole blocks and then each wrote its own copy of the partial block."""
    block_size = 16
    beams = [(6, decodes([6 * 16 + 2, 6 * 16 + 2, 6 * 16 + 2, 6 * 16 + 2]))]
    generator = torch.Generator().manual_seed(9)
    k_cache, v_cache, tables, keys, values = shared_cache(beams + [(3, decodes([60, 60, 60]))], block_size, 3, 64,
                                                          torch.float32, torch.float32, generator)
    tables[1, 6] = tables[0, 6]   # beams 0 and 1 share their 7th block too (same keys: copy them)
    keys[1][96:], values[1][96:] = keys[0][96:], values[0][96:]
    contexts = torch.tensor([98, 98, 98, 98, 60, 60, 60])
    found = find_shared_prefixes(tables.numpy(), contexts.numpy(), block_size, ALWAYS)
    assert sorted(found.shared_lens.tolist()) == [48, 96]
    q = torch.randn(7, 9, 64, generator=generator)
    out = torch.empty_like(q)
    _C.cascade_attention(out, q, *caches_of(k_cache, v_cache), tables, torch.arange(8), contexts,
                                   found.group_seqs, found.group_starts, found.shared_lens, 0.125)
    for i in range(7):
        expected = causal_reference(q[i:i + 1], keys[i], values[i], int(contexts[i]), 0.125)
        torch.testing.assert_close(out[i:i + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_several_query_rows_per_sequence(block_size):
    """Prefill chunks after a shared cached prefix, and 1 + k verification rows as speculative decoding
    shapes them, mixed with decodes; over 512 shared keys (more than one key tile)."""
    common = 640 // block_size
    groups = [(common, [(640, 1), (640, 5), (700, 37), (641, 1)]), (0, [(0, 20), (7, 1)]),
              (2, [(2 * block_size, 4), (2 * block_size + 3, 4)])]
    found = assert_matches(groups, block_size)
    assert sorted(found.shared_lens.tolist()) == [2 * block_size, 640]


@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("block_size", [16, 24])
def test_every_kv_cache_dtype(dtype, cache_dtype, block_size):
    groups = [(5, [(5 * block_size + 2, 1), (5 * block_size + 11, 1), (6 * block_size, 3)]), (0, [(20, 1)])]
    assert_matches(groups, block_size, dtype=dtype, cache_dtype=cache_dtype)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("block_size", [16, 24])
def test_groups_over_several_key_tiles(block_size, dtype, cache_dtype):
    """The pairs whose shared pass runs brgemm over tiles packed once per call (bfloat16 on AVX512-BF16, float
    queries on AVX-512; the register tiles elsewhere): two groups whose prefixes span more than one key tile
    (blocks of 24 make tiles of 504 keys, not a multiple of brgemm's 32-key alignment), with decodes,
    verification rows and a prefill chunk, and a lone sequence."""
    big = 1100 // block_size
    groups = [(big, decodes([big * block_size + i for i in range(1, 41)]) + [(big * block_size + 5, 4)]),
              (30, [(30 * block_size, 1), (30 * block_size + 2, 1), (31 * block_size + 7, 17)]),
              (0, decodes([50]))]
    found = assert_matches(groups, block_size, dtype=dtype, cache_dtype=cache_dtype)
    assert sorted(found.shared_lens.tolist()) == [30 * block_size, big * block_size]


def test_kernel_refuses_groups_whose_tables_or_lengths_disagree():
    generator = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables, _, _ = shared_cache([(2, decodes([40, 40]))], 16, 1, 16, torch.float32,
                                                  torch.float32, generator)
    q, contexts = torch.randn(2, 1, 16), torch.tensor([40, 40])
    args = (torch.empty_like(q), q, *caches_of(k_cache, v_cache))
    seqs, starts = torch.tensor([0, 1]), torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="must not pass any member's cached context"):
        _C.cascade_attention(*args, tables, torch.arange(3), contexts, seqs, starts, torch.tensor([41]), 1.0)
    other = tables.clone()
    other[1, 1] = other[1, 2]
    with pytest.raises(RuntimeError, match="must agree on the shared blocks"):
        _C.cascade_attention(*args, other, torch.arange(3), contexts, seqs, starts, torch.tensor([32]), 1.0)
    with pytest.raises(RuntimeError, match="at most once"):
        _C.cascade_attention(*args, tables, torch.arange(3), contexts, torch.tensor([0, 0]), starts,
                                       torch.tensor([32]), 1.0)


def test_search_groups_by_leading_blocks_and_cuts_at_the_shortest_context():
    tables = np.array([[7, 8, 9, 1], [7, 8, 9, 2], [3, 4, 0, 0], [7, 8, 5, 6], [3, 4, 0, 0], [11, 0, 0, 0]])
    contexts = np.array([60, 64, 20, 50, 31, 5])
    found = find_shared_prefixes(tables, contexts, 16, CascadeRule(((2, 16),)))
    groups = [sorted(found.group_seqs[a:b].tolist())
              for a, b in zip(found.group_starts[:-1].tolist(), found.group_starts[1:].tolist())]
    assert dict(zip(map(tuple, groups), found.shared_lens.tolist())) == {(2, 4): 20, (0, 1, 3): 32}
    # the threshold leaves the short group out; nothing shared at all gives None
    found = find_shared_prefixes(tables, contexts, 16, CascadeRule(((2, 21),)))
    assert found.shared_lens.tolist() == [32]
    # the group-size threshold leaves the pair out, then the trio too
    assert find_shared_prefixes(tables, contexts, 16, CascadeRule(((3, 16),))).shared_lens.tolist() == [32]
    assert find_shared_prefixes(tables, contexts, 16, CascadeRule(((4, 16),))) is None
    # a pair that never pays and a trio that needs 32 keys: only the trio
    assert find_shared_prefixes(tables, contexts, 16, CascadeRule(((2, None), (3, 32)))).shared_lens.tolist() == [32]
    assert find_shared_prefixes(tables, contexts, 16, CascadeRule(((2, None), (3, 33)))) is None
    assert find_shared_prefixes(tables[[0, 2, 5]], contexts[[0, 2, 5]], 16, ALWAYS) is None
    assert find_shared_prefixes(tables[:1], contexts[:1], 16, ALWAYS) is None
