"""Cascade attention in the engine: the same greedy tokens with the switch on and off (float32, the bundled
model), for parallel samples, beams and a shared system prompt, and proof that the cascade kernel served; the
default, auto, serving exactly the groups its start-up rule keeps, whichever way the timing went here."""
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.model.attention.cpu import CpuAttentionBackend
from pagedllm.model.cascade import ALWAYS, rule_from_timings

pytestmark = pytest.mark.kernels

# Two tokens whose log-probabilities are closer than this are a true near-tie: float32 sums taken in
# another order (the cascade merges two partial softmaxes) may swap them.
NEAR_TIE = 1e-4
# Prompts long enough that their groups share several blocks.
MIN_SHARED_TOKENS = 128
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
    assert off.llm_engine.runner.cascade_rule is None and engines[0].llm_engine.runner.cascade_rule == ALWAYS
    assert off.llm_engine.runner.cascade_parts == {"decode": 0, "prefill": 0}
    info = engines[0].llm_engine.model_info().cascade_attention
    assert (info.setting, info.rule, info.measurement) == ("on", ALWAYS, None)


def test_auto_serves_the_groups_its_startup_rule_keeps():
    """The default times the kernels at start-up and records the rule; whatever it says here, n samples of a
    prompt longer than every timed shared length go to the cascade exactly when the rule keeps n sequences."""
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory="160MiB")
    engine = llm.llm_engine
    info = engine.model_info().cascade_attention
    assert info.setting == "auto" and info.measurement is not None
    assert info.rule == engine.runner.cascade_rule == rule_from_timings(list(info.measurement.timings))
    longest = max(t.shared_len for t in info.measurement.timings)
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("The lighthouse keeper wrote in his logbook. " * 120)}
    assert len(prompt["prompt_token_ids"]) >= longest + 16
    for n in (2, 8):
        before = engine.runner.cascade_parts["decode"]
        llm.generate([prompt], SamplingParams(n=n, temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        served = engine.runner.cascade_parts["decode"] - before
        assert (served > 0) == (info.rule.min_shared_len(n) is not None), (n, served, info.describe())


def test_auto_stays_off_without_timing_where_it_must(cascade_calls):
    """batch_invariant=True (a row's result must not depend on its group) and the torch backend (no cascade
    kernel): off, and nothing timed."""
    for settings, reason in (({"batch_invariant": True}, "batch_invariant=True"),
                             ({"attention_backend": "torch", "quantization": "none"}, "attention backend torch")):
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", **settings)
        info = llm.llm_engine.model_info().cascade_attention
        assert info.rule is None and info.measurement is None and reason in info.describe()
        assert llm.llm_engine.runner.cascade_rule is None
        prompt = {"prompt_token_ids": llm.get_tokenizer().encode("Tell me about the sea. " * 20)}
        llm.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=4), use_tqdm=False)
    assert cascade_calls["decode"] == cascade_calls["prefill"] == 0


def test_enable_cascade_attention_takes_three_settings():
    from pagedllm.config import EngineConfig
    assert [EngineConfig(enable_cascade_attention=value).enable_cascade_attention
            for value in (None, "auto", True, False)] == [None, None, True, False]
    assert EngineConfig().enable_cascade_attention is None
    for value in ("yes", "on", 1, 0):
        with pytest.raises(ValueError, match=f"enable_cascade_attention must be True, False or None \\('auto'\\), "
                                             f"got {value!r}"):
            EngineConfig(enable_cascade_attention=value)
    with pytest.raises(ValueError, match="enable_cascade_attention=True does not run with batch_invariant=True"):
        EngineConfig(enable_cascade_attention=True, batch_invariant=True)
    assert EngineConfig(enable_cascade_attention=False, batch_invariant=True).batch_invariant


def test_cascade_flag_and_config_file(tmp_path):
    from pagedllm.entrypoints.cli import parse_args

    def setting(*flags, config=None):
        extra = ["--config", str(config)] if config else []
        return parse_args(["generate", *extra, *flags, "--", "hi"]).engine_config.enable_cascade_attention
    assert [setting(), setting("--enable-cascade-attention"), setting("--enable-cascade-attention", "auto"),
            setting("--enable-cascade-attention", "off"), setting("--no-enable-cascade-attention"),
            setting("--enable-cascade-attention", "on")] == [None, True, None, False, False, True]
    for text, expected in (("auto", None), ("true", True), ("false", False)):
        path = tmp_path / f"{text}.yaml"
        path.write_text(f"enable_cascade_attention: {text}\n")
        assert setting(config=path) is expected
    with pytest.raises(SystemExit):
        setting("--enable-cascade-attention", "yes")


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
    assert throughput._cascade_values("off,on,auto") == ["off", "on", "auto"]
    assert throughput.CASCADE_VALUES == {"auto": None, "on": True, "off": False}
    with pytest.raises(ValueError, match="--cascade-attention takes comma-separated auto/on/off values, got 'yes'"):
        throughput._cascade_values("yes")
