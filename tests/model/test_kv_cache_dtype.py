"""kv_cache_dtype end to end on the bundled model: every dtype generates what transformers does when its K/V
are rounded to that dtype as they are cached, a smaller dtype holds more tokens in the same memory, bad
values are refused by name."""
import copy
import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.accuracy import sequence_logprobs
from pagedllm.config import EngineConfig
from pagedllm.config.resolve import resolve_kv_cache_dtype
from pagedllm.entrypoints.cli import parse_args
from pagedllm.model.attention.cache import CacheTensor
from pagedllm.worker.model_runner import allocate_kv_caches
from tests.kv_cache_reference import RoundingCache

PROMPTS = ["Tell me a story about a robot.", "What is 2 + 2?", "Name a colour.",
           "Write a limerick about a cat who learned to code in Python.", "Explain why the sky is blue.",
           "How do vaccines work?", "Give me a recipe for pancakes.", "List three uses of Python."]
MAX_TOKENS = 16
KV_CACHE_MEMORY = 64 * 2**20
# float32 weights and activations throughout: only the KV cache's precision differs between runs.
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
TORCH_NAMES = {"auto": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp8_e5m2": "float8_e5m2",
               "int8": "int8"}
FLOAT32_TOLERANCE = 1e-4   # the suite's bound for two float32 computations of the same logprob


def generate(llm, params=GREEDY):
    outputs = llm.chat([[{"role": "user", "content": prompt}] for prompt in PROMPTS], params, use_tqdm=False)
    return [[list(completion.token_ids) for completion in output.outputs] for output in outputs]


@pytest.fixture(scope="module")
def auto_llm():
    return LLM(dtype="float32", quantization="none", kv_cache_memory=KV_CACHE_MEMORY)


def expected_num_blocks(config, kv_cache_dtype):
    """The pool for KV_CACHE_MEMORY, worked out here: per block of 16 tokens, K and V of every layer and kv
    head, head_dim elements of the dtype's size each, plus a 4-byte scale per token and kv head for int8."""
    element_bytes = {"auto": 4, "bfloat16": 2, "float16": 2, "fp8_e5m2": 1, "int8": 1}[kv_cache_dtype]
    per_head = config.head_dim * element_bytes + (4 if kv_cache_dtype == "int8" else 0)
    return KV_CACHE_MEMORY // (2 * config.num_hidden_layers * 16 * config.num_key_value_heads * per_head)


def reference_logprobs(model, sequences: list[list[int]], cache_dtype: torch.dtype) -> list[torch.Tensor]:
    """Teacher-forced log-probabilities [len - 1, vocab] of each sequence, its K/V rounded as cached."""
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([sequence]), cache=RoundingCache(cache_dtype),
                                        use_cache=True).logits[0, :-1].double(), dim=-1) for sequence in sequences]


@pytest.fixture(scope="module")
def float64_reference(bundled_reference):
    return copy.deepcopy(bundled_reference).double()


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16", "fp8_e5m2", "int8"])
def test_each_kv_cache_dtype_generates_as_transformers_with_the_same_kv_rounding(
        kv_cache_dtype, bundled_reference, float64_reference, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.llm_engine"):
        llm = LLM(dtype="float32", quantization="none", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=KV_CACHE_MEMORY)
    assert f"KV cache: {TORCH_NAMES[kv_cache_dtype]}, " in caplog.text
    engine = llm.llm_engine
    assert engine.kv_manager.pool.num_blocks == expected_num_blocks(engine.model_config, kv_cache_dtype)
    assert engine.kv_manager.pool.num_blocks > 1.8 * expected_num_blocks(engine.model_config, "auto")

    outputs = llm.chat([[{"role": "user", "content": prompt}] for prompt in PROMPTS],
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
                       use_tqdm=False)
    completions = [output.outputs[0] for output in outputs]
    sequences = [list(output.prompt_token_ids) + list(completion.token_ids)
                 for output, completion in zip(outputs, completions)]
    cache_dtype = getattr(torch, TORCH_NAMES[kv_cache_dtype])
    rows32, rows64 = ([rows[-MAX_TOKENS:] for rows in reference_logprobs(model, sequences, cache_dtype)]
                      for model in (bundled_reference, float64_reference))
    # The reference in float32 and in float64 round K/V computed in another order: where a K/V element lies
    # near a rounding boundary of cache_dtype the two land on neighbouring grid points, and the difference
    # that makes in one layer moves later layers' K/V across more boundaries. So the two references part by
    # far more than float32 noise (on this model up to ~0.01 for bfloat16, ~0.17 for fp8 e5m2's 2-bit mantissa
    # and int8's absmax / 127 steps). The engine is a third such computation (oneDNN's blocked float32 GEMMs sum
    # in yet another order), and one measured spread between two orders does not bound a third: on float16 K/V
    # the engine was measured 2.4 spreads from the float32 reference and 3.0 from the float64 one, while a
    # wrong K/V (a dropped or misplaced block) moves logprobs by far more than a few grid steps of the cache.
    # So the engine may sit a spread from either reference beyond their own spread, on top of float32 noise.
    tokens = [torch.tensor(completion.token_ids) for completion in completions]
    chosen32, chosen64 = ([rows[torch.arange(MAX_TOKENS), ids] for rows, ids in zip(reference, tokens)]
                          for reference in (rows32, rows64))
    spread = max(max((a - b).abs().max().item() for a, b in zip(chosen32, chosen64)),
                 max((a.max(-1).values - b.max(-1).values).abs().max().item() for a, b in zip(rows32, rows64)))
    tolerance = 3 * spread + FLOAT32_TOLERANCE
    for completion, reference, theirs in zip(completions, rows32, chosen32):
        ours = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)],
                            dtype=torch.float64)
        torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=0,
                                   msg=lambda text: f"{text}\n(the references' own spread: {spread:.3g})")
        # Greedy: each token is the reference's top-1, or a near tie with it: both logprobs may move by the
        # tolerance, in opposite directions.
        assert (reference.max(-1).values - theirs <= 2 * tolerance).all(), (kv_cache_dtype, tolerance)
    if kv_cache_dtype == "int8":
        # Two greedy samples per prompt share the prompt's blocks, and the partial last block is copied
        # on write: the copies must carry their scales, or the second sample would read other K/V. The two
        # samples of a prompt run in one batch on the same inputs, so they agree exactly. Against the run above
        # they need not: that ran 8 rows a step and this one 16, float layers round by batch (oneDNN's float32
        # matmuls have no batch-invariant mode), and int8's coarse K/V can turn that into a near tie's flip
        # (on an AVX2-only CPU one of the eight prompts parted at its 11th token).
        pairs = generate(llm, SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert all(len(samples) == 2 for samples in pairs)
        assert [samples[0] for samples in pairs] == [samples[1] for samples in pairs]


def test_teacher_forcing_reproduces_the_engines_own_greedy_decode(auto_llm):
    """The accuracy bench's one-prefill log-probabilities, at the positions the engine decoded one by one,
    pick the tokens it picked with the log-probabilities it reported."""
    prompt = auto_llm.get_tokenizer().encode("The history of paged memory begins")
    output = auto_llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    sequence = prompt + list(output.token_ids)
    runner = auto_llm.llm_engine.runner
    caches = allocate_kv_caches(auto_llm.llm_engine.model_config, -(-len(sequence) // runner.block_size),
                                runner.block_size, torch.float32, runner.device)
    rows = sequence_logprobs(runner, sequence, caches)[len(prompt) - 1:-1]
    tokens = torch.tensor(output.token_ids)
    assert torch.equal(rows.argmax(-1), tokens)
    reported = torch.tensor([step[token].logprob for step, token in zip(output.logprobs, output.token_ids)])
    torch.testing.assert_close(rows[torch.arange(MAX_TOKENS), tokens], reported, atol=1e-4, rtol=0)


def test_copying_blocks_copies_their_scales():
    generator = torch.Generator().manual_seed(0)
    cache = CacheTensor(torch.randint(-127, 128, (4, 2, 8, 16), generator=generator, dtype=torch.int8),
                        torch.rand(4, 2, 16, generator=generator))
    original = CacheTensor(cache.data.clone(), cache.scales.clone())
    cache.copy_blocks(torch.tensor([0, 2]), torch.tensor([3, 1]))
    for source, destination in ((0, 3), (2, 1)):
        assert torch.equal(cache.data[destination], original.data[source])
        assert torch.equal(cache.scales[destination], original.scales[source])
    assert torch.equal(cache.scales[0], original.scales[0]) and torch.equal(cache.scales[2], original.scales[2])


def test_bad_kv_cache_dtypes_are_refused_naming_the_choices(tmp_path, capsys):
    message = "kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8_e5m2, int8, got 'fp8'"
    with pytest.raises(ValueError, match=message):
        LLM(kv_cache_dtype="fp8")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    path = tmp_path / "config.yaml"
    path.write_text("engine_args:\n  kv-cache-dtype: fp8\n")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(path)])
    assert message in capsys.readouterr().err


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("kv_cache_dtype, dtype, model_dtype, device, expected", [
    ("auto", "auto", torch.float32, CPU, torch.bfloat16),      # float32 chosen for speed (no fast bfloat16 here)
    ("auto", "auto", torch.bfloat16, CPU, torch.bfloat16),
    ("auto", "float32", torch.float32, CPU, torch.float32),    # float32 asked for: the cache keeps it
    ("auto", "auto", torch.float32, CUDA, torch.float32),      # CUDA's auto is the checkpoint's own dtype
    ("float32", "auto", torch.float32, CPU, torch.float32),    # named: as named
])
def test_auto_is_the_model_dtype_unless_the_engine_chose_float32_on_a_cpu(kv_cache_dtype, dtype, model_dtype, device,
                                                                          expected):
    assert resolve_kv_cache_dtype(kv_cache_dtype, dtype, model_dtype, device) == expected


def test_a_float32_cache_under_a_narrower_model_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype float32 is for float32 models; this one runs in "
                                         "torch.bfloat16"):
        LLM(dtype="bfloat16", kv_cache_dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)


def test_the_flag_and_the_yaml_key_set_the_field(tmp_path):
    assert parse_args(["generate", "Hi", "--kv-cache-dtype", "int8"]).engine_config == EngineConfig(
        kv_cache_dtype="int8")
    path = tmp_path / "config.yaml"
    path.write_text("kv_cache_dtype: fp8_e5m2\n")
    assert parse_args(["serve", "--config", str(path)]).engine_config == EngineConfig(kv_cache_dtype="fp8_e5m2")
