"""Preemption by swap (preemption_mode swap / auto): a preempted request's KV is copied out and back instead of
recomputed, with the same tokens as an engine that never preempts, to the disk tier or to RAM staging."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.server_process import metric
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.kv_map import capture, kv_map_snapshot
from pagedllm.engine.preemption import PreemptionPolicy
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.worker.kv_disk_store import HEADER_BYTES
from pagedllm.worker.model_runner import kv_bytes_per_block

BLOCK_SIZE = 8
POOL_BLOCKS = 6
# Two prompts of 3 blocks each fill the pool; as they decode each needs a 4th block, so the later one is
# preempted, and it resumes once the first has finished, whose 48 tokens took all 6 blocks meanwhile (so
# every block of the preempted one left the prefix cache and is copied back).
PROMPTS = [list(range(10, 30)), list(range(200, 220))]
MAX_TOKENS = 28
# Every token but the last output of each request is computed once when nothing is recomputed.
TOKENS_COMPUTED_ONCE = sum(len(prompt) + MAX_TOKENS - 1 for prompt in PROMPTS)


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-kvswap"), "llama")


@pytest.fixture(scope="module")
def block_bytes(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="1MiB", block_size=BLOCK_SIZE)
    return kv_bytes_per_block(llm.llm_engine.model_config, BLOCK_SIZE, llm.llm_engine.kv_cache_dtype)


def sampling(seeded: bool) -> list[SamplingParams]:
    if seeded:
        return [SamplingParams(temperature=0.9, seed=7 + index, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
                for index in range(len(PROMPTS))]
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)] * len(PROMPTS)


def run(llm: LLM, seeded: bool) -> tuple[list[list[int]], list[float], int]:
    """Tokens, their logprobs (all requests in a row) and the tokens the engine computed over all steps."""
    computed = []
    llm.llm_engine.step_listeners.append(lambda step: computed.append(step.num_tokens))
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], sampling(seeded), use_tqdm=False)
    logprobs = [entry[token].logprob for out in outputs
                for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
    return [list(out.outputs[0].token_ids) for out in outputs], logprobs, sum(computed)


@pytest.fixture(scope="module", params=[False, True], ids=["greedy", "seeded"])
def reference(request, tiny_dir):
    """An engine whose pool holds everything: it never preempts."""
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK_SIZE)
    tokens, logprobs, computed = run(llm, request.param)
    assert computed == TOKENS_COMPUTED_ONCE
    return request.param, tokens, logprobs


def small_pool(tiny_dir, block_bytes, **kwargs) -> LLM:
    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory=POOL_BLOCKS * block_bytes, block_size=BLOCK_SIZE,
               **kwargs)


@pytest.mark.parametrize("place", ["ram", "disk"])
def test_a_swapped_request_resumes_with_the_same_tokens_and_nothing_recomputed(tiny_dir, block_bytes, reference,
                                                                             place, tmp_path):
    seeded, tokens, logprobs = reference
    extra = {"kv_cache_dir": str(tmp_path / "kv")} if place == "disk" else {}
    llm = small_pool(tiny_dir, block_bytes, preemption_mode="swap", **extra)
    got_tokens, got_logprobs, computed = run(llm, seeded)
    assert got_tokens == tokens
    assert got_logprobs == pytest.approx(logprobs, abs=1e-5)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions >= 1
    swap = stats.kv_swap
    assert swap.tier == place
    assert swap.swap_outs == swap.swap_ins == stats.num_preemptions
    assert swap.blocks_in > 0 and swap.blocks_in + swap.blocks_reused == swap.blocks_out
    assert (swap.bytes_out, swap.num_blocks, swap.refused, swap.failed_blocks) == (swap.blocks_out * block_bytes, 0, 0, 0)
    assert computed == TOKENS_COMPUTED_ONCE   # no token computed twice: the swapped request did not recompute


def test_recompute_preempts_the_same_way_and_computes_the_lost_tokens_again(tiny_dir, block_bytes, reference):
    seeded, tokens, logprobs = reference
    llm = small_pool(tiny_dir, block_bytes, preemption_mode="recompute")
    got_tokens, got_logprobs, computed = run(llm, seeded)
    assert got_tokens == tokens
    assert got_logprobs == pytest.approx(logprobs, abs=1e-5)
    assert llm.llm_engine.stats().kv_swap is None
    assert llm.llm_engine.stats().num_preemptions >= 1
    assert computed > TOKENS_COMPUTED_ONCE



def test_swap_figures_reach_prometheus_with_their_tier(tiny_dir, block_bytes, reference, tmp_path):
    seeded, tokens, _ = reference
    llm = small_pool(tiny_dir, block_bytes, preemption_mode="swap", swap_space=1)
    assert run(llm, seeded)[0] == tokens
    stats = llm.llm_engine.stats()
    text = ServerMetrics("tiny").exposition(stats).decode()
    swap = stats.kv_swap
    assert swap.capacity_blocks == 2**30 // block_bytes
    assert metric(text, "pagedllm:kv_tier_swap_outs_total", tier="ram") == swap.swap_outs >= 1
    assert metric(text, "pagedllm:kv_tier_swap_ins_total", tier="ram") == swap.swap_ins == swap.swap_outs
    assert metric(text, "pagedllm:kv_tier_swapped_out_bytes_total", tier="ram") == swap.blocks_out * block_bytes
    assert metric(text, "pagedllm:kv_tier_swapped_in_bytes_total", tier="ram") == swap.blocks_in * block_bytes
    assert metric(text, "pagedllm:kv_tier_swapped_blocks", tier="ram") == 0


def test_a_full_disk_refuses_the_swap_and_the_request_recomputes(tiny_dir, block_bytes, reference, tmp_path):
    """A disk quota of one block file: the preempted request's 3 blocks do not fit, so it recomputes."""
    seeded, tokens, logprobs = reference
    llm = small_pool(tiny_dir, block_bytes, preemption_mode="swap", kv_cache_dir=str(tmp_path / "kv"),
                     kv_cache_disk_bytes=HEADER_BYTES + block_bytes)
    got_tokens, got_logprobs, computed = run(llm, seeded)
    assert got_tokens == tokens
    assert got_logprobs == pytest.approx(logprobs, abs=1e-5)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions >= 1
    assert (stats.kv_swap.swap_outs, stats.kv_swap.refused) == (0, stats.num_preemptions)
    assert stats.kv_swap.recomputed_preemptions == stats.num_preemptions
    assert computed > TOKENS_COMPUTED_ONCE


def test_auto_swaps_where_recompute_is_dear_and_recomputes_where_it_is_cheap():
    """The rule with given measurements: recompute ~ tokens x s/token, swap ~ 2 x blocks x s/block."""
    policy = PreemptionPolicy("auto")
    assert policy.wants_swap(1000, 63)   # nothing measured yet: swap (and so measure it)
    policy.observe_prefill(num_tokens=512, seconds=1.024)       # 2 ms per prefill token
    assert policy.wants_swap(1000, 63)   # swap unmeasured
    policy.observe_swap(num_blocks=10, seconds=0.01)           # 1 ms per block each way
    assert policy.recompute_seconds(1000) == pytest.approx(2.0)
    assert policy.swap_seconds(63) == pytest.approx(0.126)
    assert policy.wants_swap(1000, 63)          # 2 s of prefill against 0.126 s of copies
    assert not policy.wants_swap(40, 63)        # 0.08 s against 0.126 s: 40 tokens spread over 63 blocks
    policy.observe_swap(num_blocks=1, seconds=1.0)              # a slow disk: the average moves to 0.2008 s/block
    assert policy.swap_seconds_per_block == pytest.approx(0.8 * 0.001 + 0.2 * 1.0)
    assert not policy.wants_swap(1000, 63)      # 25.3 s of copies against 2 s of prefill
    for mode, wanted in (("swap", True), ("recompute", False)):
        assert PreemptionPolicy(mode).wants_swap(1000, 63) is wanted


def test_auto_in_an_engine_measures_both_costs_and_keeps_the_tokens(tiny_dir, block_bytes, reference):
    seeded, tokens, _ = reference
    llm = small_pool(tiny_dir, block_bytes)   # the default: auto, RAM staging
    assert llm.llm_engine.config.preemption_mode == "auto"
    assert run(llm, seeded)[0] == tokens
    policy = llm.llm_engine.preemption
    assert policy.prefill_seconds_per_token > 0
    assert policy.counters.swapped + policy.counters.recomputed == llm.llm_engine.stats().num_preemptions >= 1
    if policy.counters.swapped:
        assert policy.swap_seconds_per_block > 0


@pytest.mark.parametrize(("settings", "message"), [
    ({"preemption_mode": "page"}, "preemption_mode must be one of recompute, swap, auto, got 'page'"),
    ({"swap_space": -1}, "swap_space must be a number of GiB >= 0, got -1"),
    ({"preemption_mode": "swap", "swap_space": 0}, "preemption_mode 'swap' needs a place for swapped blocks"),
])
def test_bad_preemption_settings_are_refused_naming_the_field(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**settings)


def test_the_kv_map_shows_swapped_out_requests_and_blocks_below_the_pool(tiny_dir, block_bytes, tmp_path):
    """Stepped by hand: while a request is swapped out its row says so and the figures count its blocks in the
    disk tier's quota, beside the cached block files."""
    llm = small_pool(tiny_dir, block_bytes, preemption_mode="swap", kv_cache_dir=str(tmp_path / "kv"))
    engine = llm.llm_engine
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, sampling(False)[index])
    seen_swapped = False
    while engine.has_unfinished_requests():
        engine.step()
        snapshot = kv_map_snapshot(engine)
        figures, kv = snapshot["figures"], engine.kv_manager
        assert (figures["num_disk_blocks"], figures["disk_capacity_blocks"]) == (len(kv.disk), kv.disk.capacity_blocks)
        assert (figures["num_swapped_blocks"], figures["swap_tier"]) == (kv.swap.num_blocks, "disk")
        swapped = [row["request_id"] for row in snapshot["requests"] if row["phase"] == "swapped out"]
        assert swapped == [request_id for request_id in engine.scheduler.requests if kv.tiers.is_swapped(request_id)
                           or kv.tiers.restored_tokens(request_id) is not None or kv.tiers.is_loading(request_id)]
        if kv.swap.num_blocks:
            seen_swapped = True
            assert swapped == ["r1"] and capture(engine).counters["num_swapped_blocks"] == 3
    assert seen_swapped


def test_ngram_speculation_runs_on_after_a_swap_in(tiny_dir, block_bytes, reference):
    """A swapped-in request proposes and verifies from its restored KV: greedy tokens as without speculation.
    (Seeded sampling under speculation draws as many numbers as the batch's proposals make it, which
    preemption changes whatever its mode, so only greedy has one right answer here.)"""
    seeded, tokens, _ = reference
    if seeded:
        pytest.skip("greedy only: see the docstring")
    llm = small_pool(tiny_dir, block_bytes, preemption_mode="swap",
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                                         "prompt_lookup_min": 1})
    assert run(llm, seeded)[0] == tokens
    stats = llm.llm_engine.stats()
    assert stats.kv_swap.swap_ins == stats.kv_swap.swap_outs >= 1
    assert stats.spec_decoding.num_draft_tokens > 0
