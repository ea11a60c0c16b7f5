"""Both prefill attention paths (model/attention/prefill_path.py: the register tiles, the brgemm tiles) against
dense attention in float32 over the same bfloat16 inputs, within a bound derived for bfloat16, and over float32
queries on float32 and bfloat16 caches to 1e-5; and how the path is chosen, forced and refused."""
import logging

import pytest
import torch

from pagedllm import LLM
from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.attention.cpu import CpuAttentionBackend
from pagedllm.model.attention.metadata import AttentionMetadata, LayerAttention
from pagedllm.model.attention.prefill_path import FORCE_VARIABLE, PrefillPath, choose_prefill_path
from pagedllm.model.attention.torch_reference import TorchAttentionBackend
from pagedllm.model.kernels import kernels as _C
from pagedllm.model.quantized_matmul import brgemm_isa
from tests.attention_reference import caches_of, causal_reference, causal_scores
from tests.model.test_attention import scattered_cache

pytestmark = pytest.mark.kernels

BF16 = torch.bfloat16
BRGEMM_ISA = brgemm_isa(BF16)
NO_BRGEMM = "oneDNN's brgemm does not run bfloat16 here (it needs AVX512-BF16 or AMX and the C++ kernels)"
PATHS = [PrefillPath("tiles"),
         pytest.param(PrefillPath("brgemm", BRGEMM_ISA), marks=pytest.mark.skipif(BRGEMM_ISA is None, reason=NO_BRGEMM))]
FLOAT_ISA = brgemm_isa(torch.float32)
FLOAT_PATHS = [PrefillPath("tiles"),
               pytest.param(PrefillPath("brgemm", FLOAT_ISA), marks=pytest.mark.skipif(
                   FLOAT_ISA is None, reason="oneDNN's brgemm does not run float32 here (it needs AVX2 and the C++ "
                                             "kernels)"))]
UNIT_ROUNDOFF = {BF16: 2.0 ** -8, torch.float32: 2.0 ** -24}   # 8 and 24 significant bits, rounded to nearest


def dense_attention_and_bound(q, keys, values, context_len, scale, window=None, softcap=None):
    """Causal attention of q [chunk, heads, head_dim] (positions context_len..) over keys/values [keys, kv_heads,
    head_dim], in float32 from the same bfloat16 values the kernel reads, and the bound on the kernel's error
    per element. Where the kernel rounds: its probabilities to bfloat16 before PV (each off by at most u = 2^-8 of
    itself; the row sum is kept in float), which moves an output by at most u * sum_j p_j |v_j|; its output to
    bfloat16, u * |o|. Its float arithmetic (products of bfloat16 are exact in float; sums of up to n terms,
    e^x by a polynomial good to 1e-7, scores off by up to head_dim * 2^-24 * scale * sum |q_i k_i|, which moves
    p_j by that much relatively, twice over with the row sum) adds (n + head_dim) * 2^-24 + 2 * that score error
    + 1e-6 relative to the same sum_j p_j |v_j|."""
    mask, scores, k, v = causal_scores(q, keys, values, context_len, scale, window, softcap)
    qf = q.float().transpose(0, 1)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = probs @ v
    float_u = UNIT_ROUNDOFF[torch.float32]
    score_error = (q.shape[-1] * float_u * scale * (qf.abs() @ k.abs().transpose(-1, -2))).masked_fill(~mask, 0)
    weighted = probs @ v.abs()   # sum_j p_j |v_j| per output element
    relative = UNIT_ROUNDOFF[BF16] + (keys.shape[0] + q.shape[-1]) * float_u + 2 * score_error.amax(-1, keepdim=True) + 1e-6
    bound = relative * weighted + UNIT_ROUNDOFF[BF16] * out.abs() * (1 + UNIT_ROUNDOFF[BF16])
    return out.transpose(0, 1), bound.transpose(0, 1)


def run_path(path, q, k_cache, v_cache, tables, chunks, scale, window=0, softcap=0.0):
    starts = torch.tensor([0] + [length for _, length in chunks]).cumsum(0)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    kernel = getattr(_C, path.op_for(max(length for _, length in chunks)))
    kernel(out, q, *caches_of(k_cache, v_cache), tables, starts, torch.tensor([context for context, _ in chunks]),
           scale, window, softcap)
    return out, starts


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (16, 2, 128)], ids=["gqa3", "mha", "gqa8"])
def test_prefill_paths_match_dense_attention_within_the_bfloat16_bound(path, block_size, heads, kv_heads, head_dim):
    """Several sequences in one call: whole prompts of 1 to 1100 tokens (more than two 512-key tiles), and chunks
    after a cached prefix (extend), one of a single token, lengths around block and tile edges."""
    generator = torch.Generator().manual_seed(26)
    chunks = [(0, 1), (0, 17), (0, 128), (0, 1100), (16, 5), (37, 64), (100, 1), (300, 400), (511, 514)]
    seq_lens = [context + length for context, length in chunks]
    k_cache, v_cache, tables, keys, values = scattered_cache(seq_lens, block_size, kv_heads, head_dim, BF16, generator)
    num_tokens = sum(length for _, length in chunks)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(BF16)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)   # strided, as the model passes it
    scale = head_dim ** -0.5
    out, starts = run_path(path, q, k_cache, v_cache, tables, chunks, scale)
    for i, (context, _) in enumerate(chunks):
        rows = slice(starts[i], starts[i + 1])
        expected, bound = dense_attention_and_bound(q[rows], keys[i], values[i], context, scale)
        error = (out[rows].float() - expected).abs()
        assert (error <= bound).all(), f"chunk {chunks[i]}: error {error.max():.3g} past the bound by " \
                                       f"{(error - bound).max():.3g}"


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("window,softcap", [(24, None), (600, None), (None, 5.0), (7, 5.0)])
def test_prefill_paths_keep_sliding_windows_and_soft_caps(path, window, softcap):
    """A window shorter than a block, one longer than a tile (the walk starts mid-grid), capped scores."""
    generator = torch.Generator().manual_seed(27)
    chunks = [(0, 40), (0, 700), (650, 300), (5, 1)]
    seq_lens = [context + length for context, length in chunks]
    k_cache, v_cache, tables, keys, values = scattered_cache(seq_lens, 16, 2, 32, BF16, generator)
    q = torch.randn(sum(length for _, length in chunks), 6, 32, generator=generator).to(BF16)
    scale = 32 ** -0.5
    out, starts = run_path(path, q, k_cache, v_cache, tables, chunks, scale, window or 0, softcap or 0.0)
    for i, (context, _) in enumerate(chunks):
        rows = slice(starts[i], starts[i + 1])
        expected, bound = dense_attention_and_bound(q[rows], keys[i], values[i], context, scale, window, softcap)
        assert ((out[rows].float() - expected).abs() <= bound).all(), f"chunk {chunks[i]}"


@pytest.mark.parametrize("block_size", [16, 24])
@pytest.mark.parametrize("cache_dtype", [torch.float32, BF16], ids=["float32 cache", "bfloat16 cache"])
@pytest.mark.parametrize("path", FLOAT_PATHS, ids=lambda path: path.name)
def test_float_queries_match_dense_attention(path, cache_dtype, block_size):
    """A float32 model's queries over a float32 cache and over a bfloat16 one (widened as read, or as packed for
    brgemm): against dense float32 attention over the values the cache holds, to 1e-5. Whole prompts across two
    512-key tiles, chunks after a cached prefix, lengths around block and tile edges (blocks of 24: tiles of 504).
    Every slot no sequence wrote holds NaN (a freed block's old bits may be any): the register tiles load whole
    vectors of a block past a sequence's last key, and no such lane may reach an output."""
    generator = torch.Generator().manual_seed(29)
    chunks = [(0, 1), (0, 37), (0, 1100), (16, 5), (300, 400), (511, 514), (1024, 32)]
    seq_lens = [context + length for context, length in chunks]
    k_cache, v_cache, tables, keys, values = scattered_cache(seq_lens, block_size, 3, 64, torch.float32, generator,
                                                             cache_dtype)
    written = torch.zeros(k_cache.data.shape[0], block_size, dtype=torch.bool)
    for table, n in zip(tables, seq_lens):
        positions = torch.arange(n)
        written[table[positions // block_size], positions % block_size] = True
    k_cache.data.masked_fill_(~written[:, None, None, :], float("nan"))   # [blocks, kv heads, head_dim, slots]
    v_cache.data.masked_fill_(~written[:, None, :, None], float("nan"))   # [blocks, kv heads, slots, head_dim]
    num_tokens = sum(length for _, length in chunks)
    q = torch.randn(num_tokens, 9, 64, generator=generator)
    out, starts = run_path(path, q, k_cache, v_cache, tables, chunks, 64 ** -0.5)
    expected = torch.cat([causal_reference(q[starts[i]:starts[i + 1]], keys[i], values[i], context, 64 ** -0.5)
                          for i, (context, _) in enumerate(chunks)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_brgemm_kernel_refuses_other_dtypes_with_the_reason():
    q = torch.zeros(4, 2, 32, dtype=torch.float16)
    k_cache, v_cache = torch.zeros(1, 1, 32, 16, dtype=torch.float16), torch.zeros(1, 1, 16, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="needs bfloat16 queries and caches, or float queries and float or bfloat16 "
                                           "caches, got Half queries and a Half cache"):
        _C.prefill_attention_brgemm(torch.empty_like(q), q, k_cache, v_cache, None, None, torch.tensor([[0]]),
                                    torch.tensor([0, 4]), torch.tensor([0]), 1.0)


def test_the_default_is_brgemm_on_amx_for_bfloat16_on_avx512_and_avx2_for_float32_and_tiles_elsewhere(monkeypatch):
    monkeypatch.delenv(FORCE_VARIABLE, raising=False)
    bfloat16 = PrefillPath("brgemm", BRGEMM_ISA) if BRGEMM_ISA == "avx512_core_amx" else PrefillPath("tiles")
    assert choose_prefill_path(BF16, BF16) == bfloat16
    float32 = {"avx512_core": PrefillPath("brgemm", FLOAT_ISA),
               "avx2": PrefillPath("brgemm", FLOAT_ISA, tiles_below=256)}.get(FLOAT_ISA, PrefillPath("tiles"))
    for cache_dtype in (torch.float32, BF16):
        assert choose_prefill_path(torch.float32, cache_dtype) == float32
    for dtype, cache_dtype in [(BF16, torch.int8), (BF16, torch.float32), (torch.float32, torch.int8),
                               (torch.float16, torch.float16)]:
        assert choose_prefill_path(dtype, cache_dtype) == PrefillPath("tiles")


def test_a_path_with_a_length_takes_brgemm_from_that_chunk_length_and_the_tiles_below_it():
    by_length = PrefillPath("brgemm", "avx2", tiles_below=256)
    assert [by_length.op_for(n) for n in (0, 1, 255, 256, 4096)] == ["prefill_attention"] * 3 + [
        "prefill_attention_brgemm"] * 2
    assert by_length.ops == ("prefill_attention_brgemm", "prefill_attention")
    assert by_length.describe() == "brgemm (oneDNN avx2); tiles for steps whose chunks are all under 256 tokens"
    always = PrefillPath("brgemm", "avx512_core")
    assert {always.op_for(n) for n in (0, 1, 4096)} == {"prefill_attention_brgemm"} and always.ops == (
        "prefill_attention_brgemm",)
    assert {PrefillPath("tiles").op_for(n) for n in (1, 4096)} == {"prefill_attention"}


@pytest.mark.parametrize("chunk", [8, 300])
def test_the_backend_runs_the_kernel_its_path_names_for_the_steps_longest_chunk(monkeypatch, chunk):
    """The default backend of a float32 model over a bfloat16 cache, one prefill chunk after 600 cached tokens: its
    output has the bits of the kernel its path names for the chunk (on AVX2 the tiles for 8 tokens, brgemm for
    300; past one 512-key tile the two sum in different orders, so their float32 results differ in the last bits),
    and both agree with dense float32 attention over the values the cache holds to 1e-5."""
    monkeypatch.delenv(FORCE_VARIABLE, raising=False)
    backend = CpuAttentionBackend(torch.float32, BF16)
    generator = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables, keys, values = scattered_cache([chunk + 600], 16, 2, 32, BF16, generator)
    q = torch.randn(chunk, 4, 32, generator=generator)
    meta = AttentionMetadata(slot_mapping=torch.zeros(chunk, dtype=torch.int64), num_decode_tokens=0,
                             decode_block_tables=tables[:0], decode_seq_lens=torch.tensor([], dtype=torch.int64),
                             prefill_query_starts=torch.tensor([0, chunk]), prefill_context_lens=torch.tensor([600]),
                             prefill_block_tables=tables, block_size=16, max_query_len=chunk)
    out = torch.empty_like(q)
    backend.prefill(out, q, None, None, k_cache, v_cache, meta, LayerAttention(32 ** -0.5))
    paths = [PrefillPath("tiles")] + ([PrefillPath("brgemm", FLOAT_ISA)] if FLOAT_ISA else [])
    results = {path.op_for(chunk): run_path(path, q, k_cache, v_cache, tables, [(600, chunk)], 32 ** -0.5)[0]
               for path in paths}
    if len(results) == 2:
        assert not torch.equal(*results.values()), "the two kernels' bits should tell them apart"
    assert torch.equal(out, results[backend.prefill_path.op_for(chunk)])
    torch.testing.assert_close(out, causal_reference(q, keys[0], values[0], 600, 32 ** -0.5), atol=1e-5, rtol=1e-5)


def test_the_environment_forces_a_path_or_says_why_it_cannot(monkeypatch):
    monkeypatch.setenv(FORCE_VARIABLE, "tiles")
    assert choose_prefill_path(BF16, BF16) == PrefillPath("tiles")
    assert choose_prefill_path(torch.float32, torch.float32) == PrefillPath("tiles")
    monkeypatch.setenv(FORCE_VARIABLE, "amx")
    with pytest.raises(ValueError, match="PAGEDLLM_ATTENTION_PATH must be one of tiles, brgemm, got 'amx'"):
        choose_prefill_path(BF16, BF16)
    monkeypatch.setenv(FORCE_VARIABLE, "brgemm")
    with pytest.raises(ValueError, match="needs a bfloat16 model and KV cache, or a float32 model and a float32 or "
                                         "bfloat16 KV cache, got a bfloat16 model and a int8 cache"):
        choose_prefill_path(BF16, torch.int8)
    if FLOAT_ISA is None:
        with pytest.raises(ValueError, match="brgemm does not run float32 on this CPU"):
            choose_prefill_path(torch.float32, BF16)
    else:
        assert choose_prefill_path(torch.float32, BF16) == PrefillPath("brgemm", FLOAT_ISA)
    if BRGEMM_ISA is None:
        with pytest.raises(ValueError, match="brgemm does not run bfloat16 on this CPU"):
            choose_prefill_path(BF16, BF16)
    else:
        assert choose_prefill_path(BF16, BF16) == PrefillPath("brgemm", BRGEMM_ISA)


@pytest.mark.skipif(BRGEMM_ISA is None, reason=NO_BRGEMM)
def test_forced_brgemm_backend_agrees_with_the_pytorch_path_inside_paged_attention(monkeypatch):
    """Through the backend as the model calls it: new K/V written, two decodes, a chunk after a cached prefix
    and a whole prompt, batch padding; against the gathering PyTorch path on the same bfloat16 cache."""
    monkeypatch.setenv(FORCE_VARIABLE, "brgemm")
    backend = CpuAttentionBackend(BF16, BF16)
    assert backend.prefill_path.name == "brgemm"
    generator = torch.Generator().manual_seed(28)
    seq_lens, new_tokens = [3, 40, 77, 20], [1, 1, 17, 20]
    k_cache, v_cache, tables, _, _ = scattered_cache(seq_lens, 16, 2, 32, BF16, generator)
    positions = torch.cat([torch.arange(n - new, n) for n, new in zip(seq_lens, new_tokens)])
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(new_tokens))
    slots = tables[rows, positions // 16] * 16 + positions % 16
    q, k_new, v_new = (torch.randn(len(rows) + 3, heads, 32, generator=generator).to(BF16) for heads in (4, 2, 2))
    results = []
    for attention in (backend, TorchAttentionBackend()):
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=2, decode_block_tables=tables[:2],
                                 decode_seq_lens=torch.tensor(seq_lens[:2]), prefill_query_starts=torch.tensor([2, 19, 39]),
                                 prefill_context_lens=torch.tensor([60, 0]), prefill_block_tables=tables[2:],
                                 block_size=16)
        caches = [CacheTensor(cache.data.clone()) for cache in (k_cache, v_cache)]
        results.append(attention.forward(q, k_new, v_new, *caches, meta, LayerAttention(32 ** -0.5)).float())
    # Both round their probabilities or their output to bfloat16 (2^-8 of values ~1 each): 2^-6 covers both.
    torch.testing.assert_close(results[0], results[1], atol=2 ** -6, rtol=2 ** -6)
    assert not results[0][-3:].any()


@pytest.mark.parametrize("path", ["tiles", pytest.param("brgemm", marks=pytest.mark.skipif(BRGEMM_ISA is None,
                                                                                          reason=NO_BRGEMM))])
def test_the_engine_start_up_log_names_the_prefill_path(path, make_tiny_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(FORCE_VARIABLE, path)
    caplog.set_level(logging.INFO, logger="pagedllm.engine.llm_engine")
    LLM(str(make_tiny_model_dir(tmp_path, "llama")), dtype="bfloat16", kv_cache_memory="16MiB")
    described = PrefillPath(path, BRGEMM_ISA if path == "brgemm" else None).describe()
    assert any(f"attention backend cpu (prefill: {described})" in record.getMessage() for record in caplog.records)
