"""Preemption by swap (preemption_mode swap / auto): a preempted request's KV is copied out and back instead of
recomputed, with the same tokens as an engine that never preempts, to the disk tier or to RAM staging."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
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

