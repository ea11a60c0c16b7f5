"""The Triton kernels against the PyTorch reference paths (the `torch` backend, and
cache.quantize for the KV write), on CPU under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 where there is no GPU) or on a GPU (`cuda` marker, run by scripts/gpu_check.sh).

Shapes are tiny: the interpreter runs each program in Python."""
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.model.attention.cache import CacheTensor, kv_cache_shapes, kv_scales_shape
from pagedllm.model.attention.metadata import AttentionMetadata, LayerAttention
from pagedllm.model.attention.torch_reference import TorchAttentionBackend

triton_kernels = pytest.importorskip("pagedllm.model.attention.triton_kernels", reason="triton is not installed")
from pagedllm.model.attention.selector import select_attention_backend  # noqa: E402

pytestmark = pytest.mark.triton
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture(autouse=True, scope="module")
def kernels_can_run():
    if not ON_GPU and not triton_kernels.INTERPRETED:
        pytest.fail("pagedllm.model.attention.triton_kernels was imported before TRITON_INTERPRET=1 was set: on CPU its kernels "
                    "cannot run (tests/conftest.py sets the variable before any test module imports it)")


def tolerance(dtype):
    """float32: the same arithmetic in another order (1e-5). On a GPU float32 dot products run in IEEE
    precision (not TF32), so the same holds. bfloat16 / float16 queries: both sides round the scores' inputs
    and the probabilities to the dtype before multiplying (2^-8 relative each for bfloat16) and the output
    to the dtype: 2e-2 on outputs of size ~1."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def random_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, generator):
    """K and V caches in the documented layout, noise in every slot (scales too), as unwritten slots may hold;
    int8 elements and scales such that the values they stand for are of size ~1, as real K/V are."""
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    scales_shape = kv_scales_shape(num_blocks, block_size, kv_heads)

    def one(shape):
        noise = torch.randn(shape, generator=generator)
        if cache_dtype != torch.int8:
            return CacheTensor(noise.to(cache_dtype).to(DEVICE))
        return CacheTensor((noise * 40).clamp(-127, 127).to(torch.int8).to(DEVICE),
                           ((0.5 + torch.rand(scales_shape, generator=generator)) / 40).to(DEVICE))
    return one(k_shape), one(v_shape)


def step_metadata(seq_lens, new_tokens, block_size, generator, num_padding=0):
    """A step's AttentionMetadata as the runner builds it: rows with one new token (decodes) first, each row's
    blocks shuffled over the pool; plus the pool size."""
    num_decodes = sum(1 for n in new_tokens if n == 1)
    assert all(n == 1 for n in new_tokens[:num_decodes]), "decodes come first"
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 2
    tables = torch.randperm(num_blocks, generator=generator)[:len(seq_lens) * max_blocks].view(len(seq_lens), -1)
    positions = torch.cat([torch.arange(n - new, n) for n, new in zip(seq_lens, new_tokens)])
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(new_tokens))
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    starts = torch.tensor([0, *new_tokens]).cumsum(0)
    lens = torch.tensor(seq_lens)
    decode_blocks = -(-max(seq_lens[:num_decodes]) // block_size) if num_decodes else 0
    on = lambda t: t.to(DEVICE)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=on(slots), num_decode_tokens=num_decodes,
        decode_block_tables=on(tables[:num_decodes, :decode_blocks].contiguous()), decode_seq_lens=on(lens[:num_decodes]),
        prefill_query_starts=on(starts[num_decodes:]), prefill_context_lens=on(lens[num_decodes:] - starts.diff()[num_decodes:]),
        prefill_block_tables=on(tables[num_decodes:]), block_size=block_size,
        query_starts=on(starts), seq_lens=on(lens), block_tables=on(tables), max_query_len=max(new_tokens),
        max_seq_len=max(seq_lens))
    return meta, num_blocks, len(rows) + num_padding


def run_both(seq_lens, new_tokens, block_size, heads, kv_heads, head_dim, dtype=torch.float32, cache_dtype=None,
             num_padding=0, seed=0):
    """paged_attention through the Triton backend and the PyTorch reference on copies of one cache."""
    cache_dtype = cache_dtype or dtype
    generator = torch.Generator().manual_seed(seed)
    meta, num_blocks, num_rows = step_metadata(seq_lens, new_tokens, block_size, generator, num_padding)
    k_cache, v_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, generator)
    # q, k, v as the model passes them: strided views into one qkv row per token
    qkv = torch.randn(num_rows, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(num_rows, -1, head_dim) for x in (q, k, v))
    triton_backend = select_attention_backend("triton", DEVICE, head_dim, block_size, dtype, cache_dtype)
    results = []
    for forward in (triton_backend.forward, TorchAttentionBackend().forward):
        caches = [CacheTensor(c.data.clone(), None if c.scales is None else c.scales.clone()) for c in (k_cache, v_cache)]
        results.append((forward(q, k, v, *caches, meta, LayerAttention(head_dim ** -0.5)), caches))
    return results, meta


def assert_same(results, dtype):
    (out, caches), (expected, expected_caches) = results
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    for cache, expected_cache in zip(caches, expected_caches):
        assert torch.equal(cache.data, expected_cache.data)
        if cache.scales is not None:
            assert torch.equal(cache.scales, expected_cache.scales)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)], ids=["group1", "group3"])
@pytest.mark.parametrize("case", ["decode", "prefill_after_prefix", "mixed_with_padding"])
def test_attention_matches_reference(case, heads, kv_heads, block_size):
    seq_lens, new_tokens, padding = {
        "decode": ([1, 9, 33, 70], [1, 1, 1, 1], 0),
        "prefill_after_prefix": ([45], [12], 0),   # 33 tokens cached, then a 12-token chunk
        # two decodes, a whole prompt, a chunk after a cached prefix, three rows of batch padding
        "mixed_with_padding": ([17, 40, 7, 29], [1, 1, 7, 20], 3),
    }[case]
    results, _ = run_both(seq_lens, new_tokens, block_size, heads, kv_heads, 32, num_padding=padding)
    assert_same(results, torch.float32)
    if padding:
        assert not results[0][0][-padding:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_in_half_precision(dtype):
    results, _ = run_both([12, 40, 30], [1, 1, 9], 16, 6, 2, 32, dtype=dtype)
    assert_same(results, dtype)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.int8), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.int8)])
def test_attention_over_a_cache_of_another_dtype(dtype, cache_dtype):
    """The KV write quantizes as cache.quantize does (bit for bit, scales included); attention reads the
    elements (times their scales) in the query's dtype, as the reference gathers them."""
    results, _ = run_both([10, 25, 30], [1, 1, 14], 8, 6, 2, 32, dtype=dtype, cache_dtype=cache_dtype)
    assert_same(results, dtype)


def test_head_size_that_is_not_a_power_of_two():
    results, _ = run_both([5, 20], [1, 6], 16, 3, 1, 24)
    assert_same(results, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_decode_merges_to_the_unsplit_result(num_splits):
    """Split-KV (a decode's keys shared over programs, then merged): the same output as one program per
    sequence; one sequence is shorter than a split's share, so some splits see no keys at all."""
    results, meta = run_both([3, 50, 70], [1, 1, 1], 8, 6, 2, 32)
    (_, caches), (expected, _) = results
    q = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    outputs = []
    for splits in (1, num_splits):
        out = torch.full_like(q, float("nan"))
        config = triton_kernels.LaunchConfig(block_m=16, key_tile=16, num_splits=splits, num_warps=4)
        triton_kernels.unified_attention(out, q, caches[0].data, caches[1].data, None, None, meta.block_tables,
                                         meta.query_starts, meta.seq_lens, 1, 70, 32 ** -0.5, config)
        outputs.append(out)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)


def test_launch_table_splits_only_long_decodes_that_leave_the_gpu_idle():
    split = triton_kernels.launch_config(num_seqs=2, max_query_len=1, max_seq_len=8192, num_kv_heads=8, group=4,
                                         block_size=16)
    assert split.num_splits == 8   # 16 programs over 132 SMs: 9 wanted, 16 by length; a power of two <= that
    assert triton_kernels.launch_config(2, 1, 600, 8, 4, 16).num_splits == 1         # short context
    assert triton_kernels.launch_config(64, 1, 8192, 8, 4, 16).num_splits == 1       # batch fills the GPU
    assert triton_kernels.launch_config(2, 7, 8192, 8, 4, 16).num_splits == 1        # a prefill chunk
    assert triton_kernels.launch_config(2, 1, 100, 2, 3, 8).key_tile == 16           # blocks < 16 keys share a tile


def test_backend_refuses_what_the_kernels_cannot_take():
    with pytest.raises(ValueError, match="kv_cache_dtype auto, bfloat16, float16 or int8, got float8_e5m2"):
        select_attention_backend("triton", DEVICE, 64, 16, torch.float32, torch.float8_e5m2)
    with pytest.raises(ValueError, match="head_dim 1..256, got 512"):
        select_attention_backend("triton", DEVICE, 512, 16, torch.float32, torch.float32)
    q = torch.zeros(4, 2, 32, device=DEVICE).transpose(1, 2).contiguous().transpose(1, 2)   # head_dim not contiguous
    k_cache, v_cache = random_cache(2, 8, 2, 32, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="q must have a contiguous last dimension"):
        triton_kernels.unified_attention(torch.empty_like(q), q, k_cache.data, v_cache.data, None, None,
                                         torch.zeros(1, 2, dtype=torch.int64, device=DEVICE),
                                         torch.tensor([0, 1], device=DEVICE), torch.tensor([1], device=DEVICE), 1, 1, 1.0)


def test_the_interpreter_is_taken_when_set_after_triton_was_imported():
    """Triton 3.9 reads TRITON_INTERPRET as each kernel is decorated: an earlier `import triton` (xgrammar's, say)
    does not fix the choice, only an earlier import of the kernel module would."""
    code = ("import os, triton\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "from pagedllm.model.attention import triton_kernels\n"
            "assert triton_kernels.INTERPRETED\n")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
