"""Cache pins (Anthropic's cache_control) in the KV layer and the scheduler: a pinned prefix's blocks stay in the
prefix cache until the deadline, pins compose by count, the bound caps them, and a request that nothing else
would make room for drops them. Block counts are computed by hand; the clock is a number the test moves."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.kv_map import kv_map_snapshot
from pagedllm.engine.request import CachePin, Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv.manager import KVCacheManager
from pagedllm.worker.model_free_runner import ModelFreeRunner
from tests.scheduling import EOS, MAX_MODEL_LEN, PLAIN, FakeModel, new_request, step

BLOCK = 4


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks: int, fraction: float = 1.0) -> tuple[KVCacheManager, Clock]:
    clock = Clock()
    return KVCacheManager(num_blocks, BLOCK, max_pinned_fraction=fraction, clock=clock), clock


def finished(kv: KVCacheManager, request_id: str, tokens: list[int], pin_tokens: int = 0, ttl_s: float = 300) -> int:
    """A request computes its prompt, pins its first pin_tokens tokens (if any) and finishes; the tokens pinned."""
    assert new_request(kv, request_id, tokens) is not None
    kv.cache_full_blocks(request_id, tokens, len(tokens))
    pinned = kv.pin_prefix(request_id, tokens, pin_tokens, ttl_s) if pin_tokens else 0
    kv.free(request_id)
    return pinned


def hit_tokens(kv: KVCacheManager, tokens: list[int], cache_salt: str | None = None) -> int:
    """The prefix-cache hit a new request of these tokens would get (looked up, not taken)."""
    hits = len(kv.get_computed_blocks("probe", tokens, cache_salt)) * BLOCK
    kv.free("probe")   # forgets the probe's hashes
    return hits


PINNED = list(range(100, 113))     # 3 full blocks + 1 token
UNPINNED = list(range(200, 213))   # the same shape


def test_a_pinned_prefix_survives_the_wave_that_evicts_an_equal_unpinned_one_until_its_deadline():
    kv, clock = manager(num_blocks=8)
    assert finished(kv, "pinned", PINNED, pin_tokens=12, ttl_s=300) == 12
    assert finished(kv, "unpinned", UNPINNED) == 0
    # 8 blocks: 3 pinned, 3 cached idle, 2 free (the partial blocks). Pinned ones are not free.
    usage = kv.usage()
    assert (usage.num_pinned_blocks, usage.num_free_blocks, usage.num_cached_idle_blocks) == (3, 5, 3)
    assert not kv.allocate_slots("too-big", 6 * BLOCK, 0)      # 6 blocks: only 5 can be had
    assert kv.allocate_slots("wave", 5 * BLOCK, 0)              # takes every free block, evicting UNPINNED's 3
    assert hit_tokens(kv, UNPINNED) == 0
    assert hit_tokens(kv, PINNED) == 12
    kv.free("wave")
    clock.now += 299
    kv.expire_pins()
    assert kv.usage().num_pinned_blocks == 3                   # one second left
    clock.now += 1
    assert kv.usage().num_pinned_blocks == 0 and kv.usage().num_free_blocks == 8
    assert kv.allocate_slots("second-wave", 8 * BLOCK, 0)       # now PINNED's blocks go too
    assert hit_tokens(kv, PINNED) == 0


def test_overlapping_pins_and_running_requests_compose_by_count():
    kv, clock = manager(num_blocks=16)
    assert new_request(kv, "running", PINNED) == 0
    kv.cache_full_blocks("running", PINNED, len(PINNED))
    assert kv.pin_prefix("running", PINNED, 8, ttl_s=100) == 8     # blocks 0, 1 until t+100
    assert kv.pin_prefix("running", PINNED, 13, ttl_s=200) == 12   # blocks 0, 1, 2 until t+200 (full blocks only)
    blocks = [kv.pool.blocks[block_id] for block_id in kv.get_block_table("running")]
    assert [(block.ref_count, block.pin_count) for block in blocks] == [(1, 2), (1, 2), (1, 1), (1, 0)]
    assert kv.usage().num_pinned_blocks == 3
    # Pinning the same prefix again moves its deadline out, without a second count.
    assert kv.pin_prefix("running", PINNED, 8, ttl_s=150) == 8
    assert [block.pin_count for block in blocks[:2]] == [2, 2]
    kv.free("running")
    assert kv.usage().num_free_blocks == 16 - 3                    # the partial block only came back
    clock.now += 100
    kv.expire_pins()
    assert [block.pin_count for block in blocks[:3]] == [2, 2, 1]   # the 2-block pin now lasts to t+150
    clock.now += 50
    kv.expire_pins()
    assert [block.pin_count for block in blocks[:3]] == [1, 1, 1] and kv.usage().num_free_blocks == 13
    # A request taking the pinned blocks as prefix hits holds them past the last pin's deadline.
    assert new_request(kv, "reader", PINNED) == 12
    clock.now += 50
    kv.expire_pins()
    assert kv.usage().num_pinned_blocks == 0
    assert [(block.ref_count, block.pin_count) for block in blocks[:3]] == [(1, 0)] * 3
    assert kv.usage().num_free_blocks == 16 - 4
    kv.free("reader")
    assert kv.usage().num_free_blocks == 16


def test_pins_follow_the_salted_hashes_so_tenants_pin_apart():
    """The same tokens under two salts are two prefixes: each tenant's pin holds its own blocks, and one
    tenant's pin gives the other no hit."""
    kv, _ = manager(num_blocks=16)
    for tenant in ("alice", "bob"):
        assert new_request(kv, tenant, PINNED, cache_salt=tenant) == 0
        kv.cache_full_blocks(tenant, PINNED, len(PINNED))
    assert kv.pin_prefix("alice", PINNED, 12, ttl_s=60) == 12
    alice_blocks = set(kv.get_block_table("alice")[:3])
    kv.free("alice")
    kv.free("bob")
    assert {block.block_id for block in kv.pool.blocks if block.pin_count} == alice_blocks
    assert kv.allocate_slots("wave", 13 * BLOCK, 0)                # every unpinned block, bob's cached ones too
    assert hit_tokens(kv, PINNED, "bob") == hit_tokens(kv, PINNED) == 0
    assert hit_tokens(kv, PINNED, "alice") == 12


def test_the_bound_shortens_a_pin_to_the_blocks_that_fit():
    kv, _ = manager(num_blocks=10, fraction=0.3)                  # at most int(0.3 * 10) = 3 pinned blocks
    assert kv.max_pinned_blocks == 3
    long_prompt = list(range(100, 117))                            # 4 full blocks + 1 token
    assert finished(kv, "long", long_prompt, pin_tokens=16) == 12  # shortened to 3 blocks
    assert finished(kv, "other", UNPINNED, pin_tokens=12) == 0     # refused: no room left
    # A prefix sharing the 3 pinned blocks costs nothing for them; its 4th block does not fit.
    assert finished(kv, "sharing", long_prompt[:16] + [7], pin_tokens=16) == 12
    assert kv.usage().num_pinned_blocks == 3


def test_nothing_pins_without_the_prefix_cache_or_with_a_zero_bound():
    for kv in (KVCacheManager(8, BLOCK, enable_prefix_caching=False, max_pinned_fraction=1.0),
               KVCacheManager(8, BLOCK, max_pinned_fraction=0.0)):
        assert finished(kv, "a", PINNED, pin_tokens=12) == 0
        assert kv.usage().num_pinned_blocks == 0 and kv.usage().num_free_blocks == 8


def test_a_pinned_block_that_is_not_cached_is_refused():
    kv, _ = manager(num_blocks=4)
    blocks = kv.pool.allocate(1)
    with pytest.raises(RuntimeError, match="not in the prefix cache"):
        kv.pool.pin(blocks, deadline=0.0, max_pinned_blocks=4)


# ---------------------------------------------------------------- through the scheduler

def scheduler(num_blocks: int, clock: Clock, max_num_seqs: int = 4) -> tuple[Scheduler, ModelFreeRunner]:
    kv = KVCacheManager(num_blocks, BLOCK, max_pinned_fraction=0.5, clock=clock)
    return Scheduler(kv, max_num_seqs, 64), ModelFreeRunner(MAX_MODEL_LEN, BLOCK, FakeModel())


def pinned_request(request_id: str, prompt: list[int], pins=(), max_tokens: int = 2) -> Request:
    return Request(request_id, prompt, PLAIN, (EOS,), max_tokens, cache_pins=tuple(pins))


def run_until_idle(sched: Scheduler, runner: ModelFreeRunner) -> None:
    while sched.has_unfinished_requests():
        step(sched, runner)


def test_the_scheduler_pins_once_the_prompt_is_computed_and_reports_the_longest_pin():
    clock = Clock()
    sched, runner = scheduler(num_blocks=16, clock=clock)
    prompt = list(range(100, 118))                                 # 4 full blocks + 2 tokens
    request = pinned_request("a", prompt, [CachePin(8, 3600), CachePin(17, 300)])
    sched.add_request(request)
    step(sched, runner)                                            # the prefill, whole
    assert request.num_pinned_tokens == 16                         # 17 tokens: 4 full blocks
    assert sched.kv_manager.usage().num_pinned_blocks == 4
    run_until_idle(sched, runner)
    assert sched.kv_manager.usage().num_pinned_blocks == 4          # the request is gone, its pins stay
    clock.now += 300
    step(sched, runner)                                            # a step drops what expired
    assert sched.kv_manager.usage().num_pinned_blocks == 2


def test_a_request_that_only_pins_block_drops_them_instead_of_waiting():
    """Pins hold half the pool; a request needing the whole of it runs once nothing else runs (its blocks could
    come from nowhere else), dropping the pins; while another request runs it waits as usual."""
    clock = Clock()
    sched, runner = scheduler(num_blocks=8, clock=clock, max_num_seqs=4)
    sched.add_request(pinned_request("pin", list(range(100, 117)), [CachePin(16, 3600)], max_tokens=1))
    run_until_idle(sched, runner)
    assert sched.kv_manager.usage().num_pinned_blocks == 4
    big = pinned_request("big", list(range(300, 330)), max_tokens=2)   # 30 + 2 tokens: all 8 blocks
    sched.add_request(big)
    plan, _ = step(sched, runner)
    assert "big" in plan.num_scheduled_tokens
    assert sched.kv_manager.usage().num_pinned_blocks == 0
    run_until_idle(sched, runner)


# ---------------------------------------------------------------- the prompt key, offline

@pytest.fixture(scope="module")
def tiny_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-pins"), "llama")


def test_the_cache_pins_prompt_key_pins_and_reports_the_pinned_tokens(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    tokens = list(range(60, 90))                                   # 3 full blocks of 8 + 6 tokens
    (output,) = llm.generate({"prompt_token_ids": tokens, "cache_pins": [CachePin(20, 60), CachePin(27, 30)]},
                             params, use_tqdm=False)
    assert output.num_pinned_tokens == 24                          # 27 tokens: 3 full blocks
    assert llm.llm_engine.kv_manager.usage().num_pinned_blocks == 3
    snapshot = kv_map_snapshot(llm.llm_engine)                     # /v1/kv_map shows them
    assert snapshot["figures"]["num_pinned_blocks"] == 3
    pinned = [block for block in snapshot["blocks"] if block["pin_count"]]
    assert [(block["pin_count"], block["cached"], block["ref_count"]) for block in pinned] == [(2, True, 0)] * 2 + [
        (1, True, 0)]                                              # the 20-token pin covers the first 2 blocks
    (again,) = llm.generate({"prompt_token_ids": tokens}, params, use_tqdm=False)
    assert (again.num_cached_tokens, again.num_pinned_tokens) == (24, 0)
    for pins, message in (([CachePin(31, 60)], "num_tokens must be an integer from 0 to the prompt's 30"),
                          ([CachePin(8, 0)], "ttl_s must be a positive number"),
                          ([CachePin(8, float("inf"))], "ttl_s must be a positive number"),
                          ([(8, 60)], "cache_pins must be a list of CachePin")):
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_token_ids": tokens, "cache_pins": pins}, params, use_tqdm=False)
    unpinned = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        unpinned.generate({"prompt_token_ids": tokens, "cache_pins": [CachePin(8, 60)]}, params, use_tqdm=False)
