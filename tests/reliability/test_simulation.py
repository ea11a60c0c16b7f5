"""The model-free days-of-traffic simulation (`python -m benchmarks.reliability.suite --simulate N`) at CI size,
and proof that each of its checks fails when the fault it looks for is planted."""
from __future__ import annotations

import pytest

from benchmarks.reliability import simulation_report, suite
from benchmarks.reliability.simulation import run_simulation
from benchmarks.reliability.simulation_checks import check_idle, check_mid_run
from benchmarks.reliability.simulation_report import PHASES, SimulationSettings
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv.invariants import check_cached_blocks, check_free_queue
from pagedllm.kv.manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.step import ModelRunnerOutput

STALL = "stall"
SMALL = PHASES[:2]   # tiny and small pools: a fast run that still preempts, forks and copies


@pytest.fixture(scope="module")
def quick_report():
    return run_simulation(SimulationSettings(requests=3000))


def test_a_few_thousand_requests_pass_every_check(quick_report):
    report = quick_report
    assert report.problems == [] and report.stalls == 0
    assert report.requests == 3000 and report.idle_points > 100 and report.mid_run_checks > 10
    # it really stressed what it checks (the run also fails itself when any of these is 0)
    assert report.preemptions > 100 and report.forks > 100 and report.beam_forks > 100
    assert report.block_copies > 100 and report.prompt_tokens_hit > 0 and report.salted_requests > 0
    assert min(report.aborts[where] for where in ("waiting", "mid-prefill", "mid-decode")) > 0
    assert len(report.heap_windows) == 2 and report.num_memory_samples == 60


def test_memory_is_flat_from_the_first_tenth_to_the_last(quick_report):
    baseline, last = quick_report.memory_window()
    assert baseline.requests_done == 300 and last.requests_done == 3000
    assert last.request_objects == 0 and last.block_objects == baseline.block_objects
    assert last.gc_objects - baseline.gc_objects <= simulation_report.MAX_OBJECT_GROWTH
    assert last.heap_blocks - baseline.heap_blocks <= simulation_report.MAX_BLOCK_GROWTH
    assert all(w.retained_bytes <= simulation_report.MAX_HEAP_RETAINED for w in quick_report.heap_windows)


def test_beam_search_never_stalls_in_a_full_pool():
    """What the simulation's stalls are, in a dozen lines: 3 blocks of 4 tokens, one beam search of width 2
    over 3 + 6 tokens (each sequence fits the pool), the search's choices made by hand between steps."""
    kv = KVCacheManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)

    def step():
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, ModelRunnerOutput([], [], []))
        return plan

    params = SamplingParams(temperature=0)
    parent = Request(request_id="b0", prompt_token_ids=[1, 2, 3], sampling_params=params, eos_token_ids=(),
                     max_tokens=6, arrival_time=0.0)
    assert kv.can_ever_fit(3 + 6)
    scheduler.add_request(parent)
    step()
    child = Request(request_id="b1", prompt_token_ids=[1, 2, 3], sampling_params=params, eos_token_ids=(),
                    max_tokens=6, arrival_time=1.0)
    scheduler.fork(parent, child)
    for extra in ((10, 20), (11, 21)):   # each beam keeps one extension per step
        parent.all_token_ids.append(extra[0])
        child.all_token_ids.append(extra[1])
        step()
    # b1 was preempted; b0 has sampled and waits for it, holding the blocks b1 needs: b0 must make way.
    assert [r.request_id for r in scheduler.waiting] == ["b1"] and parent.num_computed_tokens == parent.num_tokens
    plan = step()
    assert list(plan.num_scheduled_tokens) == ["b1"] and plan.preempted_req_ids == ["b0"], (
        f"running {[(r.request_id, r.num_tokens - r.num_computed_tokens) for r in scheduler.running]}, "
        f"waiting {[r.request_id for r in scheduler.waiting]}, {kv.pool.num_free_blocks} blocks free")
    # b1 has sampled too, so the search takes its step: b1 decodes, then the parked b0 gets its turn (it is
    # not readmitted while it has nothing new to compute).
    parent.all_token_ids.append(12)
    child.all_token_ids.append(22)
    assert list(step().num_scheduled_tokens) == ["b1"]
    plan = step()
    assert list(plan.num_scheduled_tokens) == ["b0"] and plan.preempted_req_ids == ["b1"]


# --- the checks can fail ------------------------------------------------------------------------------

def _manager_after_some_traffic() -> KVCacheManager:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(14))
    kv.get_computed_blocks("a", tokens)
    assert kv.allocate_slots("a", len(tokens), 0)
    kv.cache_full_blocks("a", tokens, len(tokens))
    kv.free("a")
    return kv


def test_a_whole_pool_passes_the_idle_check():
    kv = _manager_after_some_traffic()
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    assert check_idle(scheduler) == [] and check_mid_run(scheduler) == []


@pytest.mark.parametrize("corruption", ["skip a block", "break a back link", "cycle", "count off by one"])
def test_a_corrupted_free_queue_is_reported(corruption):
    kv = _manager_after_some_traffic()
    queue = kv.pool.free_block_queue
    first, second, third = list(queue)[:3]
    if corruption == "skip a block":       # unlinked forwards only, and still counted
        first.next_free = third
    elif corruption == "break a back link":
        third.prev_free = first
    elif corruption == "cycle":
        third.next_free = first
    else:
        queue.num_free_blocks += 1
    assert check_free_queue(kv.pool)
    assert check_idle(Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64))


def test_a_stale_cached_block_entry_is_reported():
    kv = _manager_after_some_traffic()
    block_hash, block = next(iter(kv.pool.cached_blocks.items()))
    kv.pool.cached_blocks[block_hash] = kv.pool.blocks[(block.block_id + 5) % kv.pool.num_blocks]
    assert check_cached_blocks(kv.pool)


def test_a_leaked_block_reference_is_reported_at_the_idle_check():
    kv = _manager_after_some_traffic()
    kv.pool.touch([kv.pool.blocks[2]])
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    assert any("pool not whole" in p for p in check_idle(scheduler))
    assert any("ref counts" in p for p in check_mid_run(scheduler))


def test_per_request_state_left_in_the_manager_is_reported():
    kv = _manager_after_some_traffic()
    kv.num_tokens["ghost"] = 3
    assert any("per-request state" in p for p in check_idle(Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)))


def _run(tamper=None, **settings):
    defaults = dict(requests=1000, phases=SMALL)
    return run_simulation(SimulationSettings(**{**defaults, **settings}), tamper)


def test_a_reference_leaked_mid_run_is_reported():
    def leak(step, engine):
        if step == 500:
            engine.kv.pool.touch([engine.kv.pool.blocks[0]])
    report = _run(leak)
    assert any("pool not whole" in p or "ref counts" in p for p in report.problems), report.problems


def test_a_free_queue_corrupted_mid_run_is_reported():
    def miscount(step, engine):
        if step == 300:   # one block more counted free than linked: nothing the pool does repairs it
            engine.kv.pool.free_block_queue.num_free_blocks += 1
    report = _run(miscount, beam_fraction=0.0)
    assert any("free queue" in p or "no free KV block" in p for p in report.problems), report.problems


def test_a_missed_copy_on_write_is_caught_by_the_shadow_kv():
    def drop_copies(step, engine):
        engine.kv.take_block_copies = lambda: []   # the runner would never copy the shared block
    report = _run(drop_copies)
    assert any("shadow KV" in p for p in report.problems), report.problems


def test_a_prefix_hit_across_cache_salts_is_caught_by_the_shadow_kv(monkeypatch):
    lookup = KVCacheManager.get_computed_blocks
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks",
                        lambda self, request_id, token_ids, cache_salt=None: lookup(self, request_id, token_ids))
    report = _run(salt_fraction=0.5)
    assert any("shadow KV" in p for p in report.problems), report.problems


def test_leaked_requests_are_reported(monkeypatch):
    kept = []
    finish = Scheduler.finish

    def finish_and_keep(self, request, status):
        kept.append(request)
        finish(self, request, status)
    monkeypatch.setattr(Scheduler, "finish", finish_and_keep)
    report = _run(beam_fraction=0.0)
    assert any("Request objects alive" in p for p in report.problems), report.problems
    assert any("gc-tracked objects since the first tenth" in p for p in report.problems), report.problems


def test_untracked_heap_growth_is_reported():
    kept = []

    def leak_bytes(step, engine):
        kept.append(bytes(100))   # a new untracked object per step: only heap blocks and tracemalloc see it
    report = _run(leak_bytes, beam_fraction=0.0)
    assert any("heap blocks since the first tenth" in p for p in report.problems), report.problems
    assert any(p.startswith("heap:") for p in report.problems), report.problems


def test_a_scheduler_that_stops_scheduling_is_reported_as_a_stall():
    def stop_admitting(step, engine):
        if step == 200:
            engine.scheduler.max_num_seqs = 0
    report = _run(stop_admitting, beam_fraction=0.0)
    assert report.stalls > 0 and any(STALL in p for p in report.problems)


def test_cli_runs_only_the_simulation_and_exits_with_its_verdict(capsys):
    # The smallest run whose first tenth holds a whole cycle of phases in segments of the minimum 20
    # requests: the memory baseline is taken after every phase has run (smaller runs compare against a
    # baseline taken too early, and report growth that is only warm-up).
    requests = 10 * len(PHASES) * 20
    with pytest.raises(SystemExit) as exit_info:
        suite.main(["--simulate", str(requests)])
    out = capsys.readouterr().out
    assert f"| requests | {requests:,} " in out and "| idle points checked |" in out
    assert "PROBLEM:" not in out and exit_info.value.code == 0   # a healthy engine: nothing found, exit 0


def test_an_exception_from_the_engine_is_reported_not_raised():
    def forget_a_reference(step, engine):
        held = [block for block in engine.kv.pool.blocks if block.ref_count > 0]
        if step >= 100 and held and not getattr(forget_a_reference, "done", False):
            held[0].ref_count = 0   # the pool breaks when a holder frees it
            forget_a_reference.done = True
    report = _run(forget_a_reference, check_every_steps=10**9)
    assert any("Error: " in p for p in report.problems), report.problems   # the exception, named, as a problem
