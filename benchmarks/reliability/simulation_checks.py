"""The simulation's checks; each returns, or reports, problems and none raises:

- at every idle point (nothing running or waiting): every block free with ref count 0, the free queue
  a well-formed doubly linked list holding each block once, `cached_blocks` pointing only at blocks
  whose hash says so, and no per-request state in the manager, the scheduler or the engine core;
- every `check_every_steps` steps: each block's ref count equals the number of block tables holding
  it, and the free queue holds exactly the blocks nobody holds;
- every step: a shadow of the KV cache (one token id per slot, written through the block tables as
  the runner writes K/V, block copies applied first) must read each sequence's own tokens back, with
  every block last written under the sequence's own cache salt: a wrong prefix hit, a missed
  copy-on-write or a block given to two writers shows where it happens;
- the engine must make progress whenever requests are unfinished: schedule something, and sample a
  token at least every MAX_STEPS_WITHOUT_SAMPLE steps (else it would spin for ever);
- at every segment end: gc-tracked objects, Request and KVBlock instances and live heap blocks must stay
  at their level at the end of the first tenth of the run; the heap bytes that tracemalloc sees retained
  over one traced cycle of phases, early and late, must be near zero (see `HeapWindow`, `HeapTracer`).
- at the end of a run of 1,000 requests or more: it preempted, forked, copied blocks, hit the prefix cache
  and aborted in each state (else it tested nothing there).

The KV invariants themselves live in pagedllm/kv/invariants.py; the scheduler's and the core's own state is
checked here.
"""
from __future__ import annotations

import gc
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.reliability.simulation_report import (MAX_BLOCK_GROWTH, MAX_HEAP_RETAINED, MAX_OBJECT_GROWTH,
                                                      HeapWindow, MemorySample, SimulationReport)
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv.block_pool import KVBlock
from pagedllm.kv.invariants import (check_cached_blocks, check_free_queue, check_kv_consistent, check_kv_idle,
                                    per_request_state)

NUMPY_TRACE_DOMAIN = 389047     # numpy's tracemalloc domain for array data (NPY_TRACE_DOMAIN)
NUMPY_FILES = str(Path(np.__file__).parent / "*")


def check_queues_match_tables(scheduler: Scheduler) -> list[str]:
    """Running requests own a block table, waiting (and preempted) ones none."""
    tables = scheduler.kv_manager.block_tables
    problems = []
    tableless = sum(1 for request in scheduler.running if request.request_id not in tables)
    if tableless:
        problems.append(f"{tableless} running requests have no block table")
    holding = sum(1 for request in scheduler.waiting if request.request_id in tables)
    if holding:
        problems.append(f"{holding} waiting requests still hold a block table")
    return problems


def check_mid_run(scheduler: Scheduler) -> list[str]:
    return check_kv_consistent(scheduler.kv_manager) + check_queues_match_tables(scheduler)


def check_idle(scheduler: Scheduler, *others: tuple[object, str]) -> list[str]:
    """At an idle point: the pool whole and consistent, and no per-request state anywhere: every dict,
    list and set attribute of the KV manager, of the scheduler and of each (owner, name) of `others` empty."""
    problems = check_kv_idle(scheduler.kv_manager)
    for owner, what in ((scheduler, "the scheduler"), *others):
        left = per_request_state(owner)
        if left:
            problems.append(f"{what} holds per-request state at an idle point: {', '.join(left)}")
    return problems


def evict_all(pool) -> list[str]:
    """Takes every free block and gives it back: each block's cached KV is evicted, so every memory
    sample sees the same (empty) prefix cache, and evicting a whole pool is exercised too."""
    pool.free(pool.allocate(pool.num_free_blocks))
    problems = check_free_queue(pool) + check_cached_blocks(pool)
    if pool.cached_blocks:
        problems.append(f"{len(pool.cached_blocks)} cached blocks left after evicting the whole pool")
    return problems


def release_capacity(owners) -> None:
    """Calls clear() on the owners' empty dicts and sets (lists shrink by themselves). A dict keeps
    the table of its last resize, so an empty `cached_blocks` holds anything from nothing to half a
    MiB depending on when it last grew: noise bounded by peak sizes, not growth. Changes no content."""
    for owner in owners:
        for value in vars(owner).values():
            if isinstance(value, (dict, list, set)) and not value:
                value.clear()


def measure_memory(requests_done: int) -> MemorySample:
    """Live objects after a full collection: gc-tracked ones, Request and KVBlock instances, and every
    live block of Python's allocator (untracked ints, bytes and str included), read before the census
    allocates its list of all objects."""
    gc.collect()
    heap_blocks = sys.getallocatedblocks()
    objects = gc.get_objects()
    kinds = Counter(type(obj) for obj in objects)
    sample = MemorySample(requests_done, len(objects), kinds[Request], kinds[KVBlock], heap_blocks)
    del objects, kinds
    return sample


class HeapTracer:
    """tracemalloc over the traced windows (see HeapWindow): started and stopped at segment ends, after
    end_segment has released capacity, so what is still traced at a window's end was allocated in it and kept."""

    def __init__(self, report: SimulationReport):
        self.report = report
        self.first_request = self.start_bytes = 0

    @staticmethod
    def windows(trace_heap: bool, num_phases: int, num_segments: int) -> dict[int, int]:
        """First segment -> end of each traced window: the cycle of phases that ends the first tenth,
        and the last cycle (none when the run has fewer than two cycles)."""
        if not trace_heap or num_segments < 2 * num_phases:
            return {}
        first_end = max(num_phases, num_segments // 10)
        return {first_end - num_phases: first_end, num_segments - num_phases: num_segments}

    def start(self) -> None:
        gc.collect()
        tracemalloc.start()
        self.first_request, self.start_bytes = self.report.requests, tracemalloc.get_traced_memory()[0]

    def stop(self) -> None:
        gc.collect()
        # numpy keeps a few freed small data and shape buffers of each size for reuse; which ones sit in those
        # bounded caches churns, so its array data (a domain of its own) and its own frames are left out. A
        # leaked array still shows: its object is allocated where our code makes it.
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(False, NUMPY_TRACE_DOMAIN),
                                                              tracemalloc.Filter(False, NUMPY_FILES)])
        retained = sum(trace.size for trace in snapshot.traces)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        report = self.report
        report.heap_windows.append(HeapWindow(self.first_request, report.requests - self.first_request,
                                              retained - self.start_bytes, peak))


def check_coverage(report: SimulationReport) -> None:
    """A stress run that never preempted, forked, copied, hit the cache or aborted in each state
    tested nothing there: that fails too (runs under 1,000 requests are exempt)."""
    if report.requests < 1000:
        return
    missing = [name for name, count in (
        ("preemptions", report.preemptions), ("forks", report.forks), ("beam forks", report.beam_forks),
        ("dropped beams", report.dropped_beams), ("copy-on-write copies", report.block_copies),
        ("prefix-cache hits", report.prompt_tokens_hit), ("salted requests", report.salted_requests),
        *((f"aborts {where}", report.aborts[where]) for where in ("waiting", "mid-prefill", "mid-decode")))
        if count == 0]
    if missing:
        report.problem(f"coverage: the run had no {', no '.join(missing)}", kind="coverage")


def check_memory(report: SimulationReport) -> None:
    """Every sample after the first tenth within the limits of the one that ends it, no Request alive
    at any sample, little heap retained over each traced window; one message per measure, at its worst."""
    window = report.memory_window()
    if window is None:
        return
    baseline, samples = window[0], report.memory
    alive = max(samples, key=lambda s: s.request_objects)
    if alive.request_objects:
        report.problem(f"memory: {alive.request_objects:,} Request objects alive at the idle point after "
                       f"{alive.requests_done:,} requests", kind="memory")
    later = [s for s in samples if s.requests_done > baseline.requests_done]
    for name, measure, limit in (("KVBlock objects", lambda s: abs(s.block_objects - baseline.block_objects), 0),
                                 ("gc-tracked objects", lambda s: s.gc_objects - baseline.gc_objects,
                                  MAX_OBJECT_GROWTH),
                                 ("heap blocks", lambda s: s.heap_blocks - baseline.heap_blocks, MAX_BLOCK_GROWTH)):
        worst = max(later, key=measure, default=None)
        if worst is not None and measure(worst) > limit:
            report.problem(f"memory: {measure(worst):+,} {name} since the first tenth, after "
                           f"{worst.requests_done:,} requests (limit +{limit})", kind="memory")
    for heap in report.heap_windows:
        if heap.retained_bytes > MAX_HEAP_RETAINED:
            report.problem(f"heap: {heap.retained_bytes / 1024:+.1f} KiB retained over requests "
                           f"{heap.first_request:,}-{heap.first_request + heap.requests:,} "
                           f"(limit {MAX_HEAP_RETAINED // 1024} KiB)", kind="memory")
