"""Cascade attention in the engine: the same greedy tokens with the switch on and off (float32, the bundled
model), for parallel samples, beams and a shared system prompt, and proof that the cascade kernel served."""
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.model.attention.cpu import CpuAttentionBackend
from pagedllm.model.cascade import MIN_SHARED_TOKENS

pytestmark = pytest.mark.kernels

# Two tokens whose log-probabilities are closer than this are a true near-tie: float32 sums taken in
# another order (the cascade merges two partial softmaxes) may swap them.
NEAR_TIE = 1e-4
SYSTEM_PROMPT = ("You are a careful assistant for a lighthouse museum. Answer in one friendly paragraph, "
                 "mention the keeper's logbook when it helps, and never invent dates. ") * 5


@pytest.fixture(scope="module")
def engines():
    def make(enabled):
        return LLM(dtype="float32", quantization="none", kv_cache_memory="128MiB",
                   enable_cascade_attention=enabled)
    return make(True), make(False)


@pytest.fixture
def cascade_calls(monkeypatch):
    """Counts the cascade kernel's calls by the part of the step it served (decode or prefill) and the
    largest group it saw."""
    seen = {"decode": 0, "prefill": 0, "largest_group": 0}
    kernel = CpuAttentionBackend._cascade

    def counted(backend, out, q, k_cache, v_cache, block_tables, query_starts, context_lens, groups, layer):
        part = "decode" if (query_starts.diff() == 1).all() and query_starts[0] == 0 else "prefill"
        seen[part] += 1
        seen["largest_group"] = max(seen["largest_group"], int(groups.group_starts.diff().max()))
        return kernel(backend, out, q, k_cache, v_cache, block_tables, query_starts, context_lens, groups, layer)
    monkeypatch.setattr(CpuAttentionBackend, "_cascade", counted)
    return seen


def assert_same_greedy_tokens(on, off):
    """Token for token equal; where they part, the switched-off run's top two tokens there were a near-tie."""
    for ours, theirs in zip(on, off):
        for a, b in zip(ours.outputs, theirs.outputs):
            for position, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
                if x != y:
                    first, second = sorted((p.logprob for p in b.logprobs[position].values()), reverse=True)[:2]
                    assert first - second < NEAR_TIE, f"tokens differ at {position} with a margin of {first - second}"
                    break
            else:
                assert len(a.token_ids) == len(b.token_ids)


def generate_both(engines, prompts, params):
    on, off = engines
    return on.generate(prompts, params, use_tqdm=False), off.generate(prompts, params, use_tqdm=False)


def test_parallel_samples_read_their_prompt_once_and_match(engines, cascade_calls):
    tokenizer = engines[0].get_tokenizer()
    prompt = {"prompt_token_ids": tokenizer.encode("Tell me about the history of lighthouses. " * 20)}
    assert len(prompt["prompt_token_ids"]) >= MIN_SHARED_TOKENS
    params = SamplingParams(n=4, temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    on, off = generate_both(engines, [prompt], params)
    assert len(on[0].outputs) == 4
    assert_same_greedy_tokens(on, off)
    assert cascade_calls["decode"] > 0 and cascade_calls["largest_group"] == 4


def test_beams_match(engines, cascade_calls):
    tokenizer = engines[0].get_tokenizer()
    prompt = {"prompt_token_ids": tokenizer.encode("Write a long story about a lighthouse keeper. " * 16)}
    assert len(prompt["prompt_token_ids"]) >= MIN_SHARED_TOKENS
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    on, off = (llm.beam_search([prompt], params)[0].sequences for llm in engines)
    assert [s.output_token_ids for s in on] == [s.output_token_ids for s in off]
    assert [s.cum_logprob for s in on] == pytest.approx([s.cum_logprob for s in off], abs=1e-4)
    assert cascade_calls["decode"] > 0


def test_shared_system_prompt_matches(engines, cascade_calls):
    """The system prompt is cached by a first request; then the others hit the prefix cache, so their
    prefill chunks attend to the shared cached blocks through the cascade, and so do their decodes."""
    tokenizer = engines[0].get_tokenizer()
    questions = ["When was the lighthouse built?", "Who kept the logbook?", "What colour is the lamp?",
                 "How tall is the tower?", "Can visitors climb it?", "Is there a fog horn?"]
    prompts = [{"prompt_token_ids": tokenizer.encode(SYSTEM_PROMPT + question)} for question in questions]
    assert len(tokenizer.encode(SYSTEM_PROMPT)) >= MIN_SHARED_TOKENS + 16   # whole cached blocks past it
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    warm = SamplingParams(temperature=0, max_tokens=1)
    for llm in engines:
        llm.generate(prompts[:1], warm, use_tqdm=False)
    on, off = generate_both(engines, prompts, params)
    assert_same_greedy_tokens(on, off)
    assert cascade_calls["prefill"] > 0 and cascade_calls["decode"] > 0
    assert cascade_calls["largest_group"] == len(questions)


def test_switched_off_never_calls_the_cascade(engines, cascade_calls):
    off = engines[1]
    prompt = {"prompt_token_ids": off.get_tokenizer().encode("Tell me about the sea. " * 20)}
    off.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=8), use_tqdm=False)
    assert cascade_calls == {"decode": 0, "prefill": 0, "largest_group": 0}
    assert not off.llm_engine.runner.use_cascade and engines[0].llm_engine.runner.use_cascade


def test_enable_cascade_attention_must_be_a_bool():
    from pagedllm.config import EngineConfig
    with pytest.raises(ValueError, match="enable_cascade_attention must be True or False, got 'yes'"):
        EngineConfig(enable_cascade_attention="yes")


def test_shared_prefix_workload_and_its_flags():
    import argparse

    from pagedllm.bench import throughput
    from pagedllm.bench.workload import add_workload_arguments, workload_from_args

    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    args = parser.parse_args(["--dataset", "shared-prefix", "--num-prompts", "5", "--shared-prefix-len", "40",
                              "--suffix-len", "3", "--output-len", "7"])
    workload = workload_from_args(args, vocab_size=1000)
    assert len(workload) == 5 and all(len(r.prompt_token_ids) == 43 and r.max_tokens == 7 for r in workload)
    assert len({tuple(r.prompt_token_ids[:40]) for r in workload}) == 1
    assert len({tuple(r.prompt_token_ids[40:]) for r in workload}) == 5
    assert all(100 <= t < 1000 for r in workload for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="--suffix-len must be >= 1, got 0"):
        workload_from_args(parser.parse_args(["--dataset", "shared-prefix", "--suffix-len", "0"]))
    assert throughput._cascade_values("off,on") == ["off", "on"]
    with pytest.raises(ValueError, match="--cascade-attention takes comma-separated on/off values, got 'yes'"):
        throughput._cascade_values("yes")
