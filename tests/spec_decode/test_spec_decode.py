"""Speculative decoding: exactness against speculation off and against transformers' distribution, the
p/q rule against hand-computed cases, KV rollback counts, scheduling, metrics and configuration."""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from hypothesis import given, settings, strategies as st
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.stats import EngineStats
from pagedllm.entrypoints.cli import parse_args
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.stats_logger import log_stats_periodically
from pagedllm.kv.manager import KVCacheManager
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.spec_decode.metrics import SpecDecodingStats
from pagedllm.spec_decode.ngram import propose_ngram
from pagedllm.spec_decode.planner import SpeculationPlanner
from pagedllm.worker.rejection_sampler import accept
from pagedllm.step import ModelRunnerOutput

# disable_by_batch_size None: exactness is checked with speculation in every step, whatever the batch.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": None}
# Prompts that repeat themselves, so n-gram lookup finds proposals (and a random model's loops do too).
REPEATING_PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21],
    list(range(30, 70)) + list(range(30, 40)),
    [11, 12, 13] * 9,
]


def _draft_config(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3, "disable_by_batch_size": None}


def _outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [output.outputs[0].token_ids
            for output in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _logprobs(output) -> list[dict[int, float]]:
    return [{token: entry.logprob for token, entry in position.items()} for position in output.outputs[0].logprobs]


def _assert_no_blocks_held(llm: LLM) -> None:
    pool = llm.llm_engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)


def _perturbed_copy(model_dir, folder, std: float):
    """The model with noise added to every weight: a draft that agrees with it often but not always."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(folder)
    for file in model_dir.iterdir():
        if not (folder / file.name).exists():   # the tokenizer's files
            shutil.copy(file, folder / file.name)
    return folder


@pytest.fixture(scope="module")
def tiny_models(make_tiny_model_dir, tmp_path_factory):
    """A tiny random Llama (the target) and a perturbed copy of it as the draft (same vocabulary), so that
    both acceptance and rejection happen."""
    target = make_tiny_model_dir(tmp_path_factory.mktemp("target"), "llama")
    return target, _perturbed_copy(target, tmp_path_factory.mktemp("draft"), std=0.05)


# ---- the p/q rule, by hand ----

def test_one_hot_proposal_is_accepted_with_its_target_probability():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    num_accepted, residual = accept(p, torch.tensor([1]), None, torch.tensor([0.29]))
    assert num_accepted == 1 and torch.equal(residual, p[1])   # accepted: the bonus token comes from row 1
    num_accepted, residual = accept(p, torch.tensor([1]), None, torch.tensor([0.31]))
    assert num_accepted == 0
    assert torch.allclose(residual / residual.sum(), torch.tensor([0.5, 0.0, 0.2]) / 0.7)   # p without the proposal


def test_drawn_proposal_is_accepted_with_min_one_p_over_q_and_resampled_from_the_excess():
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.2, 0.6, 0.2]])
    # p/q at token 1 is 0.5: accepted below u = 0.5, rejected above.
    assert accept(p, torch.tensor([1]), q, torch.tensor([0.49]))[0] == 1
    num_accepted, residual = accept(p, torch.tensor([1]), q, torch.tensor([0.51]))
    assert num_accepted == 0
    assert torch.allclose(residual, torch.tensor([0.3, 0.0, 0.0]))   # max(0, p - q)
    # p >= q at token 0: always accepted.
    assert accept(p, torch.tensor([0]), q, torch.tensor([0.999]))[0] == 1


def test_a_token_the_target_rules_out_is_never_accepted_and_acceptance_stops_at_the_first_rejection():
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5], [0.5, 0.5]])
    assert accept(p, torch.tensor([0, 0]), None, torch.tensor([0.0, 0.0]))[0] == 0
    p = torch.tensor([[0.0, 1.0], [0.9, 0.1], [0.25, 0.75]])
    num_accepted, residual = accept(p, torch.tensor([1, 1]), None, torch.tensor([0.5, 0.5]))
    assert num_accepted == 1 and torch.allclose(residual, torch.tensor([0.9, 0.0]))
    num_accepted, residual = accept(p, torch.tensor([1, 0]), None, torch.tensor([0.5, 0.5]))
    assert num_accepted == 2 and torch.equal(residual, p[2])   # every proposal accepted: the bonus row


# ---- proposals and configuration ----

def test_ngram_proposes_what_followed_the_first_longest_match():
    assert propose_ngram([1, 2, 3, 4, 9, 2, 3], 1, 3, 2) == [4, 9]          # "2 3" seen before, then 4 9
    assert propose_ngram([1, 2, 3, 7, 5, 2, 3, 8, 6, 2, 3], 2, 2, 3) == [7, 5, 2]   # the first of two
    assert propose_ngram([4, 1, 2, 5, 3, 1, 2, 3], 1, 3, 2) == [1, 2]       # "2 3" unseen; "3" seen at 4
    assert propose_ngram([1, 2, 3, 4], 1, 3, 4) == []
    assert propose_ngram([1, 2, 3, 4, 3], 2, 3, 4) == []                      # shorter than min_n only


def ngram_by_definition(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """propose_ngram's rule spelt out: for n from the longest down, the first window of n tokens ending before
    the last token that equals the last n tokens; what follows it."""
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        for start in range(len(token_ids) - n):
            if token_ids[start:start + n] == token_ids[len(token_ids) - n:]:
                return token_ids[start + n:start + n + num_tokens]
    return []


@settings(max_examples=400, deadline=None)
@given(token_ids=st.lists(st.integers(0, 3), max_size=40), min_n=st.integers(1, 4), extra_n=st.integers(0, 3),
       num_tokens=st.integers(1, 6))
def test_ngram_proposals_follow_the_first_longest_match_on_any_sequence(token_ids, min_n, extra_n, num_tokens):
    # A 4-token vocabulary repeats itself everywhere: many candidate windows, partial matches, ties.
    assert propose_ngram(token_ids, min_n, min_n + extra_n, num_tokens) == ngram_by_definition(
        token_ids, min_n, min_n + extra_n, num_tokens)


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min \\(5\\) must be <= prompt_lookup_max \\(3\\)"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model must name the draft"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown speculative_config key\\(s\\): k"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "many"},
     'disable_by_batch_size must be an integer >= 1, "auto" or null'),
])
def test_bad_speculative_config_names_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_speculative_config_from_flag_and_yaml(tmp_path):
    args = parse_args(["generate", "hi", "--speculative-config", json.dumps(NGRAM)])
    assert args.engine_config.speculative_config == SpeculativeConfig(**NGRAM)
    config = tmp_path / "config.yaml"
    config.write_text("engine_args:\n  speculative_config:\n    method: ngram\n    num_speculative_tokens: 3\n")
    args = parse_args(["serve", "--config", str(config)])
    assert args.engine_config.speculative_config == SpeculativeConfig("ngram", 3, prompt_lookup_max=4,
                                                                      prompt_lookup_min=2)
    with pytest.raises(SystemExit):
        parse_args(["serve", "--speculative-config", "{not json"])


# ---- scheduling and KV bookkeeping, without a model ----

def _decoding_scheduler(num_spec: int, disable_by_batch_size: int | str | None = None,
                        num_requests: int = 1, block_size: int = 4):
    """A scheduler whose requests finished their prefill (one token sampled each) and now decode."""
    config = SpeculativeConfig("ngram", num_spec, prompt_lookup_max=2, prompt_lookup_min=1,
                               disable_by_batch_size=disable_by_batch_size)
    scheduler = Scheduler(KVCacheManager(64, block_size, enable_prefix_caching=True), 16, 64,
                          speculation=SpeculationPlanner(config))
    for index in range(num_requests):
        scheduler.add_request(Request(f"r{index}", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(), (0,), max_tokens=50))
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens),
                                                        [3] * len(out.num_scheduled_tokens),
                                                        [0.0] * len(out.num_scheduled_tokens)))
    return scheduler


def test_proposals_take_budget_and_slots_and_rejected_slots_are_given_back():
    scheduler = _decoding_scheduler(num_spec=5)
    kv = scheduler.kv_manager
    request = scheduler.requests["r0"]
    assert request.all_token_ids == [1, 2, 3, 1, 2, 3, 1, 2, 3] and request.num_computed_tokens == 8
    out = scheduler.schedule()
    # "2 3" occurs earlier, followed by 1 2 3 1 2 ...: five proposals, six rows.
    assert out.spec_token_ids == {"r0": [1, 2, 3, 1, 2]} and out.num_spec_tokens == {"r0": 5}
    assert out.num_scheduled_tokens == {"r0": 6} and out.total_num_scheduled_tokens == 6
    assert len(kv.get_block_table("r0")) == 4          # slots for 8 + 6 = 14 tokens: ceil(14 / 4) blocks
    free_before = kv.pool.num_free_blocks
    # Two proposals accepted, then the target's own token: 3 rows.
    scheduler.update_from_output(out, ModelRunnerOutput(["r0"] * 3, [1, 2, 7], [0.0] * 3))
    assert request.all_token_ids[9:] == [1, 2, 7]
    assert request.num_computed_tokens == 8 + 1 + 2    # the decode token and two accepted proposals
    assert len(kv.get_block_table("r0")) == 3          # ceil(11 / 4): the block of rejected tokens only is back
    assert kv.pool.num_free_blocks == free_before + 1
    # Only verified full blocks are cached: tokens 0..7 (two blocks), not the third (tokens 8..11 incomplete).
    assert sum(block.block_hash is not None for block in kv.block_tables["r0"]) == 2
    stats = scheduler.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 5, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0, 0]


def test_budget_cuts_proposals_and_max_tokens_bounds_them():
    scheduler = _decoding_scheduler(num_spec=5)
    scheduler.max_num_batched_tokens = 3
    out = scheduler.schedule()
    assert out.num_spec_tokens == {"r0": 2} and out.num_scheduled_tokens == {"r0": 3}
    scheduler = _decoding_scheduler(num_spec=5)
    scheduler.requests["r0"].max_tokens = 3                 # one token out, two to go: the decode and one more
    assert scheduler.schedule().num_spec_tokens == {"r0": 1}


def test_speculation_is_off_in_steps_above_disable_by_batch_size():
    assert _decoding_scheduler(num_spec=2, disable_by_batch_size=3, num_requests=3).schedule().num_spec_tokens
    assert not _decoding_scheduler(num_spec=2, disable_by_batch_size=2, num_requests=3).schedule().num_spec_tokens


def test_unset_disable_by_batch_size_stops_where_speculation_was_measured_to_lose():
    """Idle bench latency (docs/speculative-decoding.md): ngram gained up to 4 running requests and lost at 8 in
    float32; a draft model gained up to 2 and lost at 4. null keeps vLLM's meaning: every batch size."""
    assert SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4}).disable_by_batch_size == 4
    assert SpeculativeConfig.from_value({"method": "draft_model", "model": "d.gguf",
                                         "num_speculative_tokens": 4}).disable_by_batch_size == 2
    assert SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4,
                                         "disable_by_batch_size": None}).disable_by_batch_size is None
    assert _decoding_scheduler(num_spec=2, disable_by_batch_size="auto", num_requests=4).schedule().num_spec_tokens
    assert not _decoding_scheduler(num_spec=2, disable_by_batch_size="auto", num_requests=5).schedule().num_spec_tokens
    assert _decoding_scheduler(num_spec=2, disable_by_batch_size=None, num_requests=5).schedule().num_spec_tokens


def test_a_stop_token_among_accepted_proposals_ends_the_request_and_frees_everything():
    scheduler = _decoding_scheduler(num_spec=5)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(["r0"] * 4, [1, 0, 3, 9], [0.0] * 4))   # 0 is EOS
    assert "r0" not in scheduler.requests
    assert scheduler.kv_manager.pool.num_free_blocks == scheduler.kv_manager.pool.num_blocks


# ---- exactness on models ----

@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_greedy_is_token_identical_on_a_tiny_model(tiny_models, block_size):
    target, draft = tiny_models
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(dtype="float32", block_size=block_size, kv_cache_memory="8MiB")
    reference = _outputs(LLM(str(target), **common), REPEATING_PROMPTS, params)
    for speculative_config in (NGRAM, _draft_config(draft)):
        llm = LLM(str(target), speculative_config=speculative_config, **common)
        assert _outputs(llm, REPEATING_PROMPTS, params) == reference
        stats = llm.stats().spec_decoding
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens   # both accepting and rejecting
        _assert_no_blocks_held(llm)


def test_verified_tokens_get_the_bits_of_the_plain_decodes_they_stand_for(tiny_models):
    """A verification's k + 1 tokens attend as decodes of their own (model/attention/metadata.py): with the
    matmul path the same at every row count (batch_invariant), each accepted token's logprobs are bitwise
    those of speculation off, where one token decodes a step."""
    target, _ = tiny_models
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    common = dict(dtype="float32", quantization="int8", batch_invariant=True, kv_cache_memory="8MiB")
    prompts = [{"prompt_token_ids": p} for p in REPEATING_PROMPTS]
    reference = LLM(str(target), **common).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), speculative_config=NGRAM, **common)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats().spec_decoding.num_accepted_tokens > 0
    for want, have in zip(reference, outputs):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert _logprobs(have) == _logprobs(want)


def test_greedy_is_token_identical_with_preemption_and_chunked_prefill(tiny_models):
    """A KV pool too small for the batch forces preemption mid-speculation; a token budget smaller than the
    prompts makes them prefill in chunks."""
    target, draft = tiny_models
    prompts = [list(range(40 + i, 90 + i)) + list(range(40 + i, 60 + i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    common = dict(dtype="float32", block_size=8, max_num_batched_tokens=32)
    small_pool = 2 * 2 * 8 * 2 * 16 * 4 * 40   # 40 blocks of 8 tokens (per-block bytes of the target: 4 KiB)
    reference = _outputs(LLM(str(target), **common), prompts, params)
    for speculative_config, pool in ((NGRAM, small_pool), (_draft_config(draft), small_pool * 3 // 2)):
        llm = LLM(str(target), speculative_config=speculative_config, kv_cache_memory=pool, **common)
        assert _outputs(llm, prompts, params) == reference
        assert llm.stats().num_preemptions > 0
        assert llm.stats().spec_decoding.num_accepted_tokens > 0
        _assert_no_blocks_held(llm)


def test_penalties_min_tokens_stop_strings_and_logprobs_apply_to_every_accepted_token(tiny_models):
    target, draft = tiny_models
    cases = [
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=25, stop_token_ids=[7, 8, 12]),
    ]
    reference_llm = LLM(str(target), dtype="float32", kv_cache_memory="8MiB")
    for speculative_config in (NGRAM, _draft_config(draft)):
        llm = LLM(str(target), dtype="float32", kv_cache_memory="8MiB", speculative_config=speculative_config)
        for params in cases:
            prompts = [{"prompt_token_ids": p} for p in REPEATING_PROMPTS]
            expected = reference_llm.generate(prompts, params, use_tqdm=False)
            got = llm.generate(prompts, params, use_tqdm=False)
            for want, have in zip(expected, got):
                assert have.outputs[0].token_ids == want.outputs[0].token_ids
                assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
                if params.logprobs:
                    for want_entry, have_entry in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
                        assert want_entry.keys() == have_entry.keys()
                        for token_id, logprob in want_entry.items():
                            assert have_entry[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)
                            assert have_entry[token_id].rank == logprob.rank
        # A stop string completed by an accepted proposal: the request ends there, tokens after it dropped.
        full = reference_llm.generate({"prompt_token_ids": REPEATING_PROMPTS[3]},
                                      SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
        stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
        params = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
        want = reference_llm.generate({"prompt_token_ids": REPEATING_PROMPTS[3]}, params, use_tqdm=False)[0]
        have = llm.generate({"prompt_token_ids": REPEATING_PROMPTS[3]}, params, use_tqdm=False)[0]
        assert (have.outputs[0].text, have.outputs[0].token_ids) == (want.outputs[0].text, want.outputs[0].token_ids)
        _assert_no_blocks_held(llm)


def test_parallel_samples_speculate_on_shared_blocks(tiny_models):
    """n = 2 greedy samples share their prompt's blocks (copy on write) and speculate from there."""
    target, draft = tiny_models
    params = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in REPEATING_PROMPTS]
    reference = LLM(str(target), dtype="float32", kv_cache_memory="8MiB").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), dtype="float32", kv_cache_memory="8MiB", speculative_config=_draft_config(draft))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in reference]
    assert llm.stats().spec_decoding.num_accepted_tokens > 0
    _assert_no_blocks_held(llm)


def test_abort_mid_speculation_frees_every_block(tiny_models):
    target, draft = tiny_models
    for speculative_config in (NGRAM, _draft_config(draft)):
        llm = LLM(str(target), dtype="float32", kv_cache_memory="8MiB", speculative_config=speculative_config)
        engine = llm.llm_engine
        for index, prompt in enumerate(REPEATING_PROMPTS):
            engine.add_request(str(index), {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        while not engine.scheduler.spec_decoding_stats.num_drafts:
            engine.step()
        engine.abort_request([str(index) for index in range(len(REPEATING_PROMPTS))])
        engine.step()
        assert not engine.has_unfinished_requests()
        _assert_no_blocks_held(llm)


def test_seeded_sampling_with_speculation_is_reproducible(tiny_models):
    target, draft = tiny_models
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=seed, ignore_eos=True)
              for seed in range(4)]
    for speculative_config in (NGRAM, _draft_config(draft)):
        runs = [_outputs(LLM(str(target), dtype="float32", kv_cache_memory="8MiB",
                             speculative_config=speculative_config), REPEATING_PROMPTS, params)
                for _ in range(2)]
        assert runs[0] == runs[1]


def _exact_distributions(model_dir, prompt: list[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' P(second output token) and P(third output token) at temperature 1, summed over the
    tokens before them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].softmax(-1).double()
        contexts = torch.tensor([prompt + [token] for token in range(vocab)])
        second_given_first = model(contexts).logits[:, -1].softmax(-1).double()       # [first, second]
        pairs = torch.tensor([prompt + [a, b] for a, b in itertools.product(range(vocab), repeat=2)])
        third_given = model(pairs).logits[:, -1].softmax(-1).double().reshape(vocab, vocab, vocab)
    second = first @ second_given_first
    joint = first[:, None] * second_given_first                                       # [first, second]
    third = torch.einsum("ab,abc->c", joint, third_given)
    return second.numpy(), third.numpy()


def test_sampling_with_speculation_keeps_the_targets_distribution(make_tiny_model_dir, tmp_path):
    """Thousands of seeded samples of the second and third output tokens (the first ones a speculative step
    produces: accepted, corrected or bonus tokens), against transformers' exact distribution: a chi-square
    test at significance 0.001 per comparison."""
    vocab = 12
    target = make_tiny_model_dir(tmp_path / "t", "llama", vocab_size=vocab, bos_token_id=1, eos_token_id=2)
    draft = _perturbed_copy(target, tmp_path / "d", std=0.2)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4]   # every token occurs with one after it: n-gram proposes
    second, third = _exact_distributions(target, prompt, vocab)
    num_samples = 3000
    # Four tokens: after the first (from the prefill), one step verifies two proposals, giving tokens 2 and 3.
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=seed, ignore_eos=True) for seed in range(num_samples)]
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
             "disable_by_batch_size": None}
    draft_model = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
                   "disable_by_batch_size": None}
    for speculative_config in (ngram, draft_model):
        llm = LLM(str(target), dtype="float32", kv_cache_memory="64MiB", max_num_seqs=256,
                  speculative_config=speculative_config)
        samples = np.array(_outputs(llm, [prompt] * num_samples, params))
        stats = llm.stats().spec_decoding
        assert stats.num_drafts >= num_samples and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        for position, exact in ((1, second), (2, third)):
            observed = np.bincount(samples[:, position], minlength=vocab)
            expected = exact / exact.sum() * num_samples
            keep = expected >= 5   # pool the rare tokens into one cell, as the test's validity asks
            observed_cells, expected_cells = observed[keep], expected[keep]
            if not keep.all():
                observed_cells = np.append(observed_cells, observed[~keep].sum())
                expected_cells = np.append(expected_cells, expected[~keep].sum())
            assert chisquare(observed_cells, expected_cells).pvalue > 1e-3, (speculative_config["method"], position)


def test_bundled_model_float32_greedy_is_token_identical(bundled_gguf_path):
    """ngram and a draft model (the same GGUF run quantized, Q4_1) against the bundled weights in float32."""
    conversations = [
        "Repeat this code exactly:\n\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n",
        "Rewrite this sentence word for word: The quick brown fox jumps over the lazy dog near the river bank.",
        "What is the capital of France?",
    ]
    params = SamplingParams(temperature=0, max_tokens=40)
    common = dict(dtype="float32", quantization="none", kv_cache_memory="64MiB")
    messages = [[{"role": "user", "content": text}] for text in conversations]

    def run(llm):
        return [output.outputs[0].token_ids for output in llm.chat(messages, params, use_tqdm=False)]

    reference = run(LLM(**common))
    for speculative_config in (NGRAM, {"method": "draft_model", "model": str(bundled_gguf_path),
                                       "num_speculative_tokens": 4, "quantization": "auto",
                                       "disable_by_batch_size": None}):
        llm = LLM(speculative_config=speculative_config, **common)
        assert run(llm) == reference
        assert llm.stats().spec_decoding.num_accepted_tokens > 0


# ---- metrics ----

def test_prometheus_exposes_vllms_spec_decode_counters(tiny_models):
    target, _ = tiny_models
    llm = LLM(str(target), dtype="float32", kv_cache_memory="8MiB", speculative_config=NGRAM)
    _outputs(llm, REPEATING_PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stats = llm.stats()
    spec = stats.spec_decoding
    assert spec.num_accepted_tokens == sum(spec.num_accepted_tokens_per_pos)
    assert spec.mean_acceptance_length == pytest.approx(1 + spec.num_accepted_tokens / spec.num_drafts)
    metrics = ServerMetrics("tiny")
    metrics.exposition(stats)
    value = metrics.registry.get_sample_value
    labels = {"model_name": "tiny"}
    assert value("pagedllm:spec_decode_num_drafts_total", labels) == spec.num_drafts
    assert value("pagedllm:spec_decode_num_draft_tokens_total", labels) == spec.num_draft_tokens
    assert value("pagedllm:spec_decode_num_accepted_tokens_total", labels) == spec.num_accepted_tokens
    for position, count in enumerate(spec.num_accepted_tokens_per_pos):
        assert value("pagedllm:spec_decode_num_accepted_tokens_per_pos_total",
                     {**labels, "position": str(position)}) == count


def test_periodic_log_line_gives_the_intervals_mean_acceptance_length(caplog):
    spec = SpecDecodingStats(4)
    kv_usage = KVCacheManager(8, 16).usage()

    class FakeState:
        class metrics:
            generated = 0.0

            @classmethod
            def token_totals(cls):
                cls.generated += 10
                return 0.0, cls.generated

        @staticmethod
        async def engine_stats():
            spec.observe(4, 3)   # each interval: one draft of 4, 3 accepted
            return EngineStats(kv_usage, 1, 0, 0, None, spec.snapshot())

    class SpecDecodingLine(logging.Handler):
        """Sets `logged` when the speculative-decoding line is emitted (on the loop's thread)."""
        def __init__(self, logged: asyncio.Event):
            super().__init__()
            self.logged = logged

        def emit(self, record: logging.LogRecord) -> None:
            if "SpecDecoding" in record.getMessage():
                self.logged.set()

    async def run():
        handler = SpecDecodingLine(asyncio.Event())
        stats_logger = logging.getLogger("pagedllm.entrypoints.openai.stats_logger")
        stats_logger.addHandler(handler)
        task = asyncio.create_task(log_stats_periodically(FakeState, interval=0))
        try:
            await asyncio.wait_for(handler.logged.wait(), 120)   # a bound for a broken logger, not a timing
        finally:
            task.cancel()
            stats_logger.removeHandler(handler)

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    line = next(record.message for record in caplog.records if "SpecDecoding" in record.message)
    assert "Mean acceptance length: 4.00" in line and "Draft acceptance rate: 75.0%" in line


def test_a_request_under_a_grammar_does_not_speculate_beside_one_that_does():
    """The grammar's bitmask covers one row per step, so a constrained request decodes one token at a time
    while a plain one in the same batch speculates; each gives what it gives alone without speculation."""
    from pagedllm import StructuredOutputsParams

    common = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=24,
                                 structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))
    prompts = ["one two three four one two three four one two three four one two",
               "The phone number is"]
    reference = LLM(**common).generate(prompts, [plain, constrained], use_tqdm=False)
    llm = LLM(speculative_config=NGRAM, **common)
    alone = llm.generate(prompts[1:], [constrained], use_tqdm=False)
    assert llm.stats().spec_decoding.num_drafts == 0
    together = llm.generate(prompts, [plain, constrained], use_tqdm=False)
    assert llm.stats().spec_decoding.num_drafts > 0
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", together[1].outputs[0].text)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in reference]
    assert alone[0].outputs[0].token_ids == reference[1].outputs[0].token_ids
    _assert_no_blocks_held(llm)
