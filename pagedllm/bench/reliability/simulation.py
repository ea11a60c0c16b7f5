"""Days of traffic, simulated: the real Scheduler, KVCacheManager and BlockPool driven without a model.

Why: a block allocator that fragments or leaks is what makes "restart after 24 h" advice necessary. This
run pushes up to millions of requests through the real bookkeeping: random prompt and output lengths,
shared prefixes and repeated prompts (prefix-cache hits), per-tenant cache salts, n > 1 parallel
samples forked from one prefill, beam search forking and dropping beams, aborts while waiting,
mid-prefill and mid-decode, storms that exhaust the pool, and pools from 16 blocks to 8,192. It checks
that nothing is left behind and nothing is mixed up:

- at every idle point (nothing running or waiting): every block free with ref count 0, the free queue
  a well-formed doubly linked list holding each block once, `cached_blocks` pointing only at blocks
  whose hash says so, and no per-request state in the manager or the scheduler;
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
  over one traced cycle of phases, early and late, must be near zero (see `HeapWindow`).

Sampled tokens are random ids: bookkeeping does not depend on their meaning, and distinct ids keep the
prefix cache honest (only shared prefixes and repeated prompts hit).
"""
from __future__ import annotations

import gc
import random
import sys
import time
import tracemalloc
from array import array
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from pagedllm.engine.beam_search import BeamSearch, BeamSearchParams
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv.invariants import check_cached_blocks, check_free_queue, check_ref_counts
from pagedllm.kv.manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.step import ModelRunnerOutput
from pagedllm.worker.model_free_runner import ModelFreeRunner

VOCAB = 32000
# Allowed growth from the sample that ends the first tenth of the run to any later one, and heap
# retained over a traced cycle. Samples are taken at idle points with every container's spare
# capacity released (release_capacity), so a leak-free run stays within a few objects; a leak of one
# object per thousand requests would pass 900 over a million.
MAX_OBJECT_GROWTH = 100          # gc-tracked objects
MAX_BLOCK_GROWTH = 500           # live heap blocks (sys.getallocatedblocks: ints, bytes, str included)
MAX_HEAP_RETAINED = 64 * 1024    # bytes retained over one traced cycle (30,000 requests in a million)
# Steps without a single sampled token before the engine counts as stuck: the longest prefill here
# (2,048 tokens at 64 a step) takes 32, so this leaves room for heavy preemption yet ends a livelock.
MAX_STEPS_WITHOUT_SAMPLE = 1000
NUMPY_TRACE_DOMAIN = 389047     # numpy's tracemalloc domain for array data (NPY_TRACE_DOMAIN)
NUMPY_FILES = str(Path(np.__file__).parent / "*")
MAX_PROBLEMS = 10                # messages kept of each kind (stall, memory, check...); the count is exact


@dataclass(frozen=True)
class Phase:
    """One engine configuration. The run cycles through the phases segment by segment; each keeps its
    own scheduler and KV manager for the whole run, so state piling up across segments would show."""
    name: str
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    burst: tuple[int, int]            # requests per burst (a burst ends at an idle point)
    storm_probability: float = 0.05   # a burst that arrives at once, long, and exhausts the pool
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"


PHASES = (
    Phase("tiny", num_blocks=16, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
          max_model_len=256, burst=(2, 24), storm_probability=0.2),
    Phase("small, priority", num_blocks=64, block_size=16, max_num_seqs=32, max_num_batched_tokens=256,
          max_model_len=512, burst=(8, 64), policy="priority"),
    Phase("small, block 8, whole prefills", num_blocks=160, block_size=8, max_num_seqs=32,
          max_num_batched_tokens=512, max_model_len=512, burst=(8, 64), enable_chunked_prefill=False),
    Phase("medium, no prefix cache", num_blocks=512, block_size=16, max_num_seqs=64,
          max_num_batched_tokens=512, max_model_len=1024, burst=(16, 128), enable_prefix_caching=False),
    Phase("medium, block 32", num_blocks=384, block_size=32, max_num_seqs=128, max_num_batched_tokens=1024,
          max_model_len=1024, burst=(32, 192)),
    Phase("large", num_blocks=8192, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048,
          max_model_len=2048, burst=(128, 512), storm_probability=0.1),
)


@dataclass(frozen=True)
class SimulationSettings:
    requests: int
    seed: int = 0
    phases: tuple[Phase, ...] = PHASES
    segment_requests: int | None = None   # requests per segment (one phase each); default from `requests`
    check_every_steps: int = 1000         # mid-run ref-count check interval
    parallel_fraction: float = 0.15       # n in 2..4
    beam_fraction: float = 0.08           # beam width in 2..4
    abort_fraction: float = 0.06
    salt_fraction: float = 0.1            # requests with one of four cache salts (tenants)
    trace_heap: bool = True               # tracemalloc over two cycles of phases (see HeapWindow)

    def segment_size(self) -> int:
        """Small enough that the first tenth holds a full cycle of phases, so the baseline sample comes
        after every phase has run; at most 5,000, so that a million requests make 200 segments."""
        if self.segment_requests:
            return self.segment_requests
        return max(20, min(5000, self.requests // (10 * len(self.phases))))


class MemorySample(NamedTuple):
    requests_done: int
    gc_objects: int
    request_objects: int
    block_objects: int
    heap_blocks: int      # sys.getallocatedblocks(): every live allocation of the Python allocator


class HeapWindow(NamedTuple):
    """tracemalloc only sees what is allocated while it runs, and tracing every allocation slows this
    run about 5.5 times (a million requests: 33 minutes instead of 6), so it runs over two windows of one
    full cycle of phases each, one ending with the first tenth of the run and one ending the run. Both
    start and end at idle points with all spare capacity released; what is still traced at the end was
    allocated in the window and kept: a leak of a few bytes per request shows, an unchanged state is ~0."""
    first_request: int
    requests: int
    retained_bytes: int
    peak_bytes: int


@dataclass
class SimulationReport:
    settings: SimulationSettings
    requests: int = 0
    sequences: int = 0            # every Request object: children, forks, beams
    steps: int = 0
    preemptions: int = 0
    aborts: Counter = field(default_factory=Counter)   # where: waiting / mid-prefill / mid-decode
    parallel_requests: int = 0
    forks: int = 0                # parallel-sample forks
    beam_requests: int = 0
    beam_forks: int = 0
    dropped_beams: int = 0
    block_copies: int = 0         # copy-on-write copies the runner would make
    storms: int = 0
    stalls: int = 0
    salted_requests: int = 0
    prompt_tokens_looked_up: int = 0
    prompt_tokens_hit: int = 0
    idle_points: int = 0
    mid_run_checks: int = 0
    shadow_reads: int = 0
    # MemorySample fields, flat and preallocated, so that recording a sample allocates nothing
    memory_samples: array = field(default_factory=lambda: array("q"))
    num_memory_samples: int = 0
    heap_windows: list[HeapWindow] = field(default_factory=list)
    wall_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    num_problems: int = 0
    problem_kinds: Counter = field(default_factory=Counter)

    def problem(self, text: str, kind: str = "check") -> None:
        """Counts every problem; keeps the first messages of each kind, so that a thousand stalls
        cannot hide one leak."""
        self.num_problems += 1
        self.problem_kinds[kind] += 1
        if self.problem_kinds[kind] <= MAX_PROBLEMS:
            self.problems.append(text)

    def record_memory(self, sample: MemorySample) -> None:
        width = len(sample)
        index = self.num_memory_samples * width
        self.memory_samples[index:index + width] = array("q", sample)
        self.num_memory_samples += 1

    @property
    def memory(self) -> list[MemorySample]:
        width, values = len(MemorySample._fields), self.memory_samples
        return [MemorySample(*values[i * width:(i + 1) * width]) for i in range(self.num_memory_samples)]

    def memory_window(self) -> tuple[MemorySample, MemorySample] | None:
        """(baseline, final): the last sample within the first tenth of the requests, and the last one."""
        samples = self.memory
        if not samples:
            return None
        early = [s for s in samples if s.requests_done <= self.requests / 10] or samples[:1]
        return early[-1], samples[-1]

    @property
    def hit_rate(self) -> float:
        return self.prompt_tokens_hit / self.prompt_tokens_looked_up if self.prompt_tokens_looked_up else 0.0

    def table(self) -> str:
        window = self.memory_window()
        objects = "no sample"
        if window:
            first, last = window
            objects = (f"{first.gc_objects:,} -> {last.gc_objects:,} gc-tracked ({last.gc_objects - first.gc_objects:+,};"
                       f" limit +{MAX_OBJECT_GROWTH}); {first.heap_blocks:,} -> {last.heap_blocks:,} heap blocks "
                       f"({last.heap_blocks - first.heap_blocks:+,}; limit +{MAX_BLOCK_GROWTH}); Request "
                       f"{first.request_objects} -> {last.request_objects}; KVBlock "
                       f"{first.block_objects:,} -> {last.block_objects:,}")
        if self.heap_windows:
            heap = ", ".join(f"{w.retained_bytes / 1024:+.1f} KiB over requests {w.first_request:,}-"
                             f"{w.first_request + w.requests:,} (peak {w.peak_bytes / 2**20:.1f} MiB)"
                             for w in self.heap_windows) + f"; limit +{MAX_HEAP_RETAINED // 1024} KiB"
        else:
            heap = "not traced" if not self.settings.trace_heap else "run too short for two traced cycles"
        aborts = self.aborts
        rows = [
            ("requests", f"{self.requests:,} ({self.sequences:,} sequences with forks and beams; "
                         f"{self.salted_requests:,} with a cache salt)"),
            ("steps", f"{self.steps:,}"),
            ("preemptions", f"{self.preemptions:,} ({self.storms:,} storm bursts)"),
            ("aborts", f"{sum(aborts.values()):,} (waiting {aborts['waiting']:,}, mid-prefill "
                       f"{aborts['mid-prefill']:,}, mid-decode {aborts['mid-decode']:,})"),
            ("parallel sampling (n = 2-4)", f"{self.parallel_requests:,} requests, {self.forks:,} forks"),
            ("beam search (width 2-4)", f"{self.beam_requests:,} requests, {self.beam_forks:,} beam forks, "
                                        f"{self.dropped_beams:,} dropped beams"),
            ("copy-on-write block copies", f"{self.block_copies:,}"),
            ("prefix-cache hit rate", f"{self.hit_rate:.1%} of {self.prompt_tokens_looked_up:,} prompt tokens"),
            ("idle points checked", f"{self.idle_points:,} (+ {self.mid_run_checks:,} mid-run ref-count "
                                    f"checks, {self.shadow_reads:,} shadow-KV read-backs)"),
            ("stalls (no progress, requests unfinished)", f"{self.stalls:,}"),
            ("live objects, first tenth -> last", objects),
            ("heap retained over a traced cycle (tracemalloc), first tenth / last", heap),
            ("pool sizes used (blocks x tokens)", ", ".join(f"{p.num_blocks} x {p.block_size}"
                                                           for p in self.settings.phases)),
            ("wall time", f"{self.wall_seconds:.0f} s"),
            ("checks", "all passed" if not self.num_problems else f"{self.num_problems} FAILED"),
        ]
        lines = ["| figure | value |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Checks: each returns a list of problems (empty when the property holds) and never raises.

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
    kv = scheduler.kv_manager
    return (check_ref_counts(kv) + check_free_queue(kv.pool) + check_cached_blocks(kv.pool)
            + check_queues_match_tables(scheduler))


def _containers(owner) -> list[tuple[str, dict | list | set]]:
    return [(name, value) for name, value in vars(owner).items() if isinstance(value, (dict, list, set))]


def check_idle(scheduler: Scheduler) -> list[str]:
    """At an idle point: the pool whole and consistent, and no per-request state anywhere: every dict,
    list and set attribute of the manager and of the scheduler empty, whatever it is called."""
    kv = scheduler.kv_manager
    pool = kv.pool
    problems = []
    held = [block for block in pool.blocks if block.ref_count != 0]
    if held:
        problems.append(f"pool not whole: {len(held)} blocks still referenced "
                        f"(e.g. {', '.join(repr(b) for b in held[:3])})")
    if pool.num_free_blocks != pool.num_blocks:
        problems.append(f"pool not whole: {pool.num_free_blocks} of {pool.num_blocks} blocks free")
    problems += check_free_queue(pool) + check_cached_blocks(pool)
    for owner, what in ((kv, "the KV manager"), (scheduler, "the scheduler")):
        left = [f"{name} ({len(value)})" for name, value in _containers(owner) if value]
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
        for _, value in _containers(owner):
            if not value:
                value.clear()


def measure_memory(requests_done: int) -> MemorySample:
    """Live objects after a full collection: gc-tracked ones, Request and KVBlock instances, and every
    live block of Python's allocator (untracked ints, bytes and str included), read before the census
    allocates its list of all objects."""
    from pagedllm.kv.block_pool import KVBlock
    gc.collect()
    heap_blocks = sys.getallocatedblocks()
    objects = gc.get_objects()
    kinds = Counter(type(obj) for obj in objects)
    sample = MemorySample(requests_done, len(objects), kinds[Request], kinds[KVBlock], heap_blocks)
    del objects, kinds
    return sample


# ---------------------------------------------------------------------------------------------------
# The shadow KV cache.

class ShadowKV:
    """One token id per KV slot, and per block the cache salt of its last writer: the runner's writes
    and block copies without tensors. A sequence read back through its block table must give its own
    tokens, from blocks all written under its own salt."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.salts: list[str | None] = [None] * num_blocks

    def clear(self) -> None:
        """Forgets every slot: once the whole pool is evicted no block's content may be read again
        (and slots holding old token ids would keep those ints alive)."""
        self.slots[:] = [None] * len(self.slots)
        self.salts[:] = [None] * len(self.salts)

    def copy(self, copies: list[tuple[int, int]]) -> None:
        size, slots = self.block_size, self.slots
        for source, target in copies:
            slots[target * size:(target + 1) * size] = slots[source * size:(source + 1) * size]
            self.salts[target] = self.salts[source]

    def write(self, block_ids: list[int], tokens: list[int], start: int, count: int, salt: str | None) -> None:
        size, slots, salts = self.block_size, self.slots, self.salts
        if count == 1:   # a decode step
            block = block_ids[start // size]
            slots[block * size + start % size] = tokens[start]
            salts[block] = salt
            return
        end = start + count
        while start < end:
            offset = start % size
            take = min(size - offset, end - start)
            block = block_ids[start // size]
            slots[block * size + offset:block * size + offset + take] = tokens[start:start + take]
            salts[block] = salt
            start += take

    def reads_back(self, block_ids: list[int], tokens: list[int], count: int, salt: str | None) -> bool:
        """Whether the first `count` tokens read through the table are the sequence's own."""
        size, slots, salts = self.block_size, self.slots, self.salts
        for index in range(0, count, size):
            take = min(size, count - index)
            block = block_ids[index // size]
            if slots[block * size:block * size + take] != tokens[index:index + take] or salts[block] != salt:
                return False
        return True


# ---------------------------------------------------------------------------------------------------
# The workload.

@dataclass(eq=False)
class Job:
    """One user request: a plain sequence, n parallel samples, or a beam search."""
    kind: str                         # "plain", "parallel" or "beam"
    prompt: list[int]
    max_tokens: int
    arrival: int                      # burst step at which it arrives
    abort_at: int | None
    abort_in_prefill: bool = False    # aborted at the first step that leaves it mid-prefill
    priority: int = 0
    salt: str | None = None
    width: int = 1                    # n, or the beam width
    live: list[Request] = field(default_factory=list)      # unfinished plain or parallel sequences
    pending: list[Request] = field(default_factory=list)   # parallel samples the scheduler has not forked yet
    search: BeamSearch | None = None                       # a beam job's search, which owns its beams

    def sequences(self) -> list[Request]:
        """Its unfinished sequences in the scheduler."""
        return [beam.request for beam in self.search.live] if self.search is not None else self.live


class Workload:
    """Random jobs: prompts built from shared prefixes (so full blocks repeat across requests), exact
    repeats of recent prompts (whole-prompt hits), random suffixes; mostly short outputs."""

    def __init__(self, rng: random.Random, settings: SimulationSettings):
        self.rng = rng
        self.settings = settings
        self.prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(8, 600))] for _ in range(48)]
        self.recent: list[list[int]] = []   # a small ring of recent prompts, emptied at each segment end

    def prompt(self, phase: Phase, storm: bool) -> list[int]:
        """Mostly a shared prefix and a short random suffix; in a storm, long and mostly unique, so
        that sharing cannot keep even the largest pool from filling up."""
        rng = self.rng
        limit = phase.max_model_len // (2 if storm else 4)
        roll = rng.random()
        if self.recent and roll < 0.08 and not storm:
            return list(rng.choice(self.recent))
        prompt = []
        if roll < (0.2 if storm else 0.6):   # a shared prefix, the popular ones far more often
            prefix = self.prefixes[int(len(self.prefixes) * rng.random() ** 2)]
            prompt = prefix[:rng.randint(limit // 4, limit)]
        random_ = rng.random
        suffix = rng.randint(limit // 2, limit) if storm else rng.randint(1, max(1, limit // 3))
        prompt += [int(random_() * VOCAB) for _ in range(suffix)]
        prompt = prompt[:phase.max_model_len - 1]
        if len(self.recent) < 16:
            self.recent.append(prompt)
        else:
            self.recent[rng.randrange(16)] = prompt
        return prompt

    def job(self, phase: Phase, arrival: int, storm: bool) -> Job:
        rng, settings = self.rng, self.settings
        prompt = self.prompt(phase, storm)
        room = phase.max_model_len - len(prompt)
        long = storm or rng.random() < 0.05
        max_tokens = rng.randint(1, max(1, room // 2) if long else min(room, 24))
        roll = rng.random()
        kind, width = "plain", 1
        if roll < settings.parallel_fraction:
            kind, width = "parallel", rng.randint(2, 4)
        elif roll < settings.parallel_fraction + settings.beam_fraction:
            kind, width = "beam", rng.randint(2, 4)
        abort_at, abort_in_prefill = None, False
        if rng.random() < settings.abort_fraction:   # early (waiting), mid-prefill if it ever is, or any time
            roll = rng.random()
            prefill = 1 + 2 * len(prompt) // phase.max_num_batched_tokens   # steps, with a shared budget
            abort_in_prefill = roll < 0.4   # and no timed abort: most prompts never are mid-prefill
            if not abort_in_prefill:
                abort_at = arrival + rng.randint(0, prefill if roll < 0.6 else 2 * (prefill + max_tokens))
        salt = f"tenant-{rng.randrange(4)}" if rng.random() < settings.salt_fraction else None
        return Job(kind, prompt, max_tokens, arrival, abort_at, abort_in_prefill,
                   priority=rng.randrange(4) if phase.policy == "priority" else 0, salt=salt, width=width)


# ---------------------------------------------------------------------------------------------------
# The driver.

STOP = VOCAB       # the token that ends a plain or parallel sequence early (random ids stay below VOCAB)
EOS = VOCAB + 1    # a beam that picks it is complete
PARAMS = SamplingParams(temperature=0, stop_token_ids=[STOP])   # one shared instance


class Engine:
    """One phase's scheduler, KV manager, worker batch and shadow KV, kept for the whole run."""

    def __init__(self, phase: Phase, sample):
        self.phase = phase
        self.kv = KVCacheManager(phase.num_blocks, phase.block_size, phase.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, phase.max_num_seqs, phase.max_num_batched_tokens,
                                   phase.enable_chunked_prefill, phase.policy)
        # Rows for twice max_num_seqs (forks join beyond it), so the batch's arrays are not still growing
        # to their high-water mark in a traced window.
        self.runner = ModelFreeRunner(phase.max_model_len, phase.block_size, partial(sample, self),
                                      capacity=2 * phase.max_num_seqs)
        self.shadow = ShadowKV(phase.num_blocks, phase.block_size)


class Simulation:
    """Runs the settings' requests segment by segment. `tamper(step, engine)`, if given, is called after
    every step: tests use it to plant a fault that the checks must report. `progress(report)`, if given,
    is called after each tenth of the segments."""

    def __init__(self, settings: SimulationSettings, tamper: Callable[[int, Engine], None] | None = None,
                 progress: Callable[[SimulationReport], None] | None = None):
        self.settings = settings
        self.tamper = tamper
        self.progress = progress
        self.rng = random.Random(settings.seed)
        self.workload = Workload(self.rng, settings)
        self.report = SimulationReport(settings)
        self.engines: list[Engine] = []
        self.owner: dict[str, Job] = {}      # live plain / parallel sequence id -> its job
        self.stop_at: dict[str, int] = {}    # live plain / parallel sequence id -> length it stops at
        self.searches: dict[BeamSearch, Job] = {}
        self.next_id = 0
        self.clock = 0.0                     # arrival times: a counter, so that order is exact
        self.step = 0
        self.steps_without_sample = 0
        self.failed = False                  # a structural check failed: stop, the state is unreliable

    # -- running

    def run(self) -> SimulationReport:
        settings, report = self.settings, self.report
        started = time.perf_counter()
        # What the process held before (torch, a test session...) goes to the collector's permanent
        # generation: collections and the object census then see only the run's own objects, and cost
        # milliseconds instead of a second in a big process. Unfrozen at the end.
        gc.collect()
        gc.freeze()
        self.engines = [Engine(phase, self.sample) for phase in settings.phases]
        size = settings.segment_size()
        num_segments = -(-settings.requests // size)
        report.memory_samples = array("q", bytes(8 * len(MemorySample._fields) * num_segments))
        windows = self.heap_windows(num_segments)
        tracing = None
        try:
            for segment in range(num_segments):
                if self.failed:
                    break
                if segment in windows:
                    tracing = self.start_tracing()
                engine = self.engines[segment % len(self.engines)]
                self.run_segment(engine, min(size, settings.requests - report.requests))
                self.end_segment(engine)
                if tracing is not None and segment + 1 in windows.values():
                    self.stop_tracing(*tracing)
                    tracing = None
                if self.progress is not None and (segment + 1) * 10 // num_segments > segment * 10 // num_segments:
                    report.wall_seconds = time.perf_counter() - started
                    self.progress(report)
        except Exception as exc:   # noqa: BLE001 - e.g. a pool that raises on a free: reported, not a traceback
            self.fail([f"{type(exc).__name__}: {exc}"], f"step {self.step}")
        finally:
            if tracemalloc.is_tracing():
                tracemalloc.stop()
            gc.unfreeze()
        for engine in self.engines:
            report.preemptions += engine.scheduler.num_preemptions
            report.prompt_tokens_looked_up += engine.kv.prefix_cache_queries
            report.prompt_tokens_hit += engine.kv.prefix_cache_hits
        if not self.failed:
            self.check_coverage()
            self.check_memory()
        report.wall_seconds = time.perf_counter() - started
        return report

    def heap_windows(self, num_segments: int) -> dict[int, int]:
        """First segment -> end of each traced window: the cycle of phases that ends the first tenth,
        and the last cycle (none when the run has fewer than two cycles)."""
        cycle = len(self.settings.phases)
        if not self.settings.trace_heap or num_segments < 2 * cycle:
            return {}
        first_end = max(cycle, num_segments // 10)
        return {first_end - cycle: first_end, num_segments - cycle: num_segments}

    def start_tracing(self) -> tuple[int, int]:
        gc.collect()
        tracemalloc.start()
        return self.report.requests, tracemalloc.get_traced_memory()[0]

    def stop_tracing(self, first_request: int, start_bytes: int) -> None:
        """Called after end_segment has released capacity: what is traced now was kept."""
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
        report.heap_windows.append(HeapWindow(first_request, report.requests - first_request,
                                              retained - start_bytes, peak))

    def fail(self, problems: list[str], where: str) -> None:
        for problem in problems:
            self.report.problem(f"{where}: {problem}")
        if problems:
            self.failed = True

    def run_segment(self, engine: Engine, requests: int) -> None:
        rng, phase = self.rng, engine.phase
        while requests > 0 and not self.failed:
            storm = rng.random() < phase.storm_probability
            if storm:   # twice what the engine runs at once, all at step 0, long
                count = min(requests, 2 * phase.max_num_seqs)
                self.report.storms += 1
            else:
                count = min(requests, rng.randint(*phase.burst))
            spread = 0 if storm else rng.randint(0, 4 * count)
            arrivals = sorted(rng.randint(0, spread) for _ in range(count))
            self.run_burst(engine, [self.workload.job(phase, at, storm) for at in arrivals])
            requests -= count

    def run_burst(self, engine: Engine, jobs: list[Job]) -> None:
        """Steps until every job of the burst is done, checking the pool each time the engine empties."""
        scheduler = engine.scheduler
        aborts: dict[int, list[Job]] = {}
        for job in jobs:
            if job.abort_at is not None:
                aborts.setdefault(job.abort_at, []).append(job)
        arrived, now, busy = 0, 0, False
        while not self.failed:
            while arrived < len(jobs) and jobs[arrived].arrival <= now:
                self.admit(engine, jobs[arrived])
                arrived += 1
            for job in aborts.pop(now, ()):
                if job.sequences():
                    self.abort(engine, job)
            if not scheduler.has_unfinished_requests():
                if busy:
                    self.idle_point(engine)
                    busy = False
                if arrived == len(jobs):
                    break
                now = jobs[arrived].arrival
                continue
            busy = True
            if not self.run_step(engine):
                self.stall(engine, jobs, "nothing schedulable")
            elif self.steps_without_sample > MAX_STEPS_WITHOUT_SAMPLE:
                self.stall(engine, jobs, f"no token sampled in {MAX_STEPS_WITHOUT_SAMPLE:,} steps")
            now += 1

    def admit(self, engine: Engine, job: Job) -> None:
        """Queues a job as LLMEngine.add_request does: one request, its parallel siblings to be forked from
        it, or a beam search's first beam."""
        report = self.report
        report.requests += 1
        report.salted_requests += job.salt is not None
        self.next_id += 1
        if job.kind == "beam":
            report.beam_requests += 1
            report.sequences += 1
            job.search = BeamSearch(f"r{self.next_id}", job.prompt, BeamSearchParams(job.width, job.max_tokens),
                                    (EOS,), job.max_tokens, job.salt, self.tick(), job.priority)
            self.searches[job.search] = job
            engine.scheduler.add_request(job.search.first_request)
            return
        arrival = self.tick()
        first = self.new_request(job, f"r{self.next_id}", arrival)
        job.live.append(first)
        if job.kind == "parallel":
            report.parallel_requests += 1
            job.pending = [self.new_request(job, f"r{self.next_id}.{index}", arrival)
                           for index in range(1, job.width)]
        engine.scheduler.add_request(first, job.pending)

    def new_request(self, job: Job, request_id: str, arrival_time: float) -> Request:
        self.report.sequences += 1
        request = Request(request_id=request_id, prompt_token_ids=job.prompt, sampling_params=PARAMS,
                          eos_token_ids=(), max_tokens=job.max_tokens, arrival_time=arrival_time,
                          priority=job.priority, cache_salt=job.salt)
        self.owner[request_id] = job
        self.stop_at[request_id] = self.stop_length(job)
        return request

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def stop_length(self, job: Job) -> int:
        """The total length a sample stops at: prompt + max_tokens (length) or earlier (a stop token)."""
        rng = self.rng
        return len(job.prompt) + (job.max_tokens if rng.random() < 0.6 else rng.randint(1, job.max_tokens))

    def run_step(self, engine: Engine) -> bool:
        """One engine step as LLMEngine.step takes it, with the model-free runner: schedule, let the runner
        apply the step to its batch and "sample" (self.sample writes the shadow KV through the runner's own
        block tables), then update_from_output; afterwards the simulation's own records catch up.
        False when the scheduler did nothing although requests are unfinished."""
        scheduler, report = engine.scheduler, self.report
        try:
            plan = scheduler.schedule()
        except Exception as exc:   # noqa: BLE001 - any exception from the scheduler is a finding
            self.fail([f"{type(exc).__name__}: {exc}"], f"step {self.step} ({engine.phase.name}): schedule()")
            return True
        if not plan.num_scheduled_tokens:   # a request that preempted itself: a step without a token
            engine.runner.execute_model(plan)
            self.steps_without_sample += 1
            return bool(plan.preempted_req_ids)
        self.step += 1
        report.steps += 1
        if plan.block_copies:
            report.block_copies += len(plan.block_copies)
            engine.shadow.copy(plan.block_copies)
        forked = [scheduler.requests[request.request_id] for request in plan.scheduled_new_reqs
                  if request.sample_with is not None]
        report.forks += len(forked)
        beams_before = {job: job.sequences() for job in self.beam_jobs_in(scheduler, plan)}
        try:
            output = engine.runner.execute_model(plan)
            prefill_aborts = self.prefill_aborts(scheduler, plan)
            sampled = scheduler.update_from_output(plan, output)
            self.steps_without_sample = 0 if output.req_ids else self.steps_without_sample + 1
            self.catch_up(sampled, forked, beams_before)
            for job in prefill_aborts:
                if job.sequences():
                    self.abort(engine, job)
        except Exception as exc:   # noqa: BLE001
            self.fail([f"{type(exc).__name__}: {exc}"], f"step {self.step} ({engine.phase.name}): run or update")
        if self.step % self.settings.check_every_steps == 0:
            report.mid_run_checks += 1
            self.fail(check_mid_run(scheduler), f"step {self.step} ({engine.phase.name}), mid-run")
        if self.tamper is not None:
            self.tamper(self.step, engine)
        return True

    def beam_jobs_in(self, scheduler: Scheduler, plan) -> list[Job]:
        jobs = []
        for request_id in plan.num_scheduled_tokens:
            search = scheduler.requests[request_id].beam_search
            if search is not None and self.searches[search] not in jobs:
                jobs.append(self.searches[search])
        return jobs

    def prefill_aborts(self, scheduler: Scheduler, plan) -> list[Job]:
        """Jobs marked to abort mid-prefill whose first sequence this step leaves mid-prompt."""
        jobs = []
        for request_id, count in plan.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            job = self.job_of(request)
            if job.abort_in_prefill and request.num_computed_tokens + count < request.num_prompt_tokens:
                jobs.append(job)
        return jobs

    def job_of(self, request: Request) -> Job:
        return self.searches[request.beam_search] if request.beam_search is not None else self.owner[request.request_id]

    def sample(self, engine: Engine, batch, rows, num_new, sampling_rows) -> ModelRunnerOutput:
        """The runner's step without a model: every computed token is written to the shadow KV through the
        runner's own block table (so a wrong step delta shows), prefills that end and sequences about to
        end read back; then random tokens (a stop token where the sequence is to stop) or, for beams,
        random candidates (EOS among them now and then)."""
        scheduler, shadow, random_ = engine.scheduler, engine.shadow, self.rng.random
        requests = scheduler.requests
        for row, count in zip(rows.tolist(), num_new.tolist()):
            request_id = batch.req_ids[row]
            request = requests[request_id]
            start = int(batch.num_computed_tokens[row])
            table = batch.block_table[row, :batch.num_blocks[row]].tolist()
            tokens = batch.token_ids[row, :batch.num_tokens[row]].tolist()
            shadow.write(table, tokens, start, count, request.cache_salt)
            if count > 1 and start + count == len(tokens):   # a prefill just ended: prefix hits must read back
                self.read_back(engine, request, start + count)
        req_ids = [batch.req_ids[row] for row in sampling_rows.tolist()]
        token_ids, top_ids, top_values = [], [], []
        for request_id in req_ids:
            request = requests[request_id]
            if request.beam_search is not None:
                width = 2 * request.beam_search.params.beam_width
                candidates = [EOS if random_() < 0.015 else int(random_() * VOCAB) for _ in range(width)]
                top_ids.append(candidates)
                top_values.append([-3 * random_() for _ in range(width)])
                token_ids.append(candidates[0])
                self.read_back(engine, request, request.num_tokens)   # the search may end or drop it
                continue
            top_ids.append([])
            top_values.append([])
            ends = request.num_tokens + 1 >= self.stop_at[request_id]
            length_stop = self.stop_at[request_id] - request.num_prompt_tokens == request.max_tokens
            token_ids.append(STOP if ends and not length_stop else int(random_() * VOCAB))
            if ends:
                self.read_back(engine, request, request.num_tokens)
        return ModelRunnerOutput(req_ids, token_ids, [0.0] * len(req_ids), top_ids, top_values)

    def catch_up(self, sampled, forked: list[Request], beams_before: dict[Job, list[Request]]) -> None:
        """The simulation's records after update_from_output: forked siblings are live, finished sequences
        are forgotten, beam forks and dropped beams counted."""
        for sibling in forked:
            job = self.owner[sibling.request_id]
            job.pending.remove(sibling)
            job.live.append(sibling)
        for request, _ in sampled:
            if request.is_finished:
                self.forget(request)
        for job, before in beams_before.items():
            after = job.sequences()
            self.report.beam_forks += sum(1 for request in after if request not in before)
            self.report.dropped_beams += sum(1 for request in before
                                             if request.status is RequestStatus.FINISHED_ABORTED)
            if job.search.finished:
                del self.searches[job.search]

    def read_back(self, engine: Engine, request: Request, count: int) -> None:
        self.report.shadow_reads += 1
        block_ids = engine.kv.get_block_table(request.request_id)
        if not engine.shadow.reads_back(block_ids, request.all_token_ids, count, request.cache_salt):
            self.fail([f"{request.request_id} reads back other tokens (or another salt's) than its own through "
                       f"its block table ({count} computed tokens, table {block_ids})"],
                      f"step {self.step} ({engine.phase.name}), shadow KV")

    def forget(self, request: Request) -> None:
        job = self.owner.pop(request.request_id)
        self.stop_at.pop(request.request_id)
        job.live.remove(request)

    def abort(self, engine: Engine, job: Job) -> None:
        """As LLMEngine.abort_request: every unfinished sequence of the job ends, wherever it is, after a
        last read-back through its table."""
        first = job.sequences()[0]
        if first.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            where = "waiting"
        elif first.num_computed_tokens < first.num_prompt_tokens:
            where = "mid-prefill"
        else:
            where = "mid-decode"
        self.report.aborts[where] += 1
        for request in job.sequences():
            if request.request_id in engine.kv.block_tables:
                self.read_back(engine, request, request.num_computed_tokens)
        if job.search is not None:
            job.search.abort(engine.scheduler)
            del self.searches[job.search]
            return
        for request in list(job.live):
            engine.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self.forget(request)
        for request in job.pending:   # never forked: the engine finishes them too (nothing to free)
            engine.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self.owner.pop(request.request_id)
            self.stop_at.pop(request.request_id)
        job.pending = []

    def stall(self, engine: Engine, jobs: list[Job], how: str) -> None:
        """Requests are unfinished but the engine makes no progress (nothing scheduled, or no token
        sampled for many steps): it would spin here for ever. Reported; then the burst's jobs are aborted
        (as clients giving up) and the run goes on."""
        scheduler = engine.scheduler
        self.report.stalls += 1
        idle_running = sum(r.num_computed_tokens == r.num_tokens for r in scheduler.running)
        self.report.problem(kind="stall", text=
            f"step {self.step} ({engine.phase.name}): stall, {how}, with {len(scheduler.running)} running "
            f"({idle_running} waiting for sibling beams) and {len(scheduler.waiting)} waiting; "
            f"{engine.kv.pool.num_free_blocks} of {engine.kv.pool.num_blocks} blocks free")
        for job in jobs:
            if job.sequences():
                self.abort(engine, job)
        self.steps_without_sample = 0

    # -- checking

    def idle_point(self, engine: Engine) -> None:
        """Checks that nothing is left; first the step that tells the runner of the last finished requests
        (the engine sends it with the next step), which must schedule nothing and empty the runner's batch."""
        self.report.idle_points += 1
        plan = engine.scheduler.schedule()
        engine.runner.execute_model(plan)
        problems = check_idle(engine.scheduler)
        if plan.num_scheduled_tokens:
            problems.append(f"an idle scheduler scheduled {len(plan.num_scheduled_tokens)} requests")
        batch = engine.runner.input_batch
        if batch.req_ids or batch.row_of or batch.generators:
            problems.append(f"the runner's batch still holds {len(batch.req_ids)} rows")
        if self.owner or self.stop_at or self.searches:
            problems.append(f"the simulation itself still tracks {len(self.owner) + len(self.searches)} sequences")
        self.fail(problems, f"idle point after step {self.step} ({engine.phase.name})")

    def end_segment(self, engine: Engine) -> None:
        """Evicts the segment's cached blocks, releases spare capacity and takes a memory sample."""
        if self.failed:
            return
        self.fail(evict_all(engine.kv.pool), f"segment end ({engine.phase.name})")
        engine.shadow.clear()
        self.workload.recent.clear()
        release_capacity([self, self.workload, self.report] + [owner for e in self.engines for owner in (
            e.kv, e.kv.pool, e.scheduler, e.runner.input_batch)])
        self.report.record_memory(measure_memory(self.report.requests))

    def check_coverage(self) -> None:
        """A stress run that never preempted, forked, copied, hit the cache or aborted in each state
        tested nothing there: that fails too (runs under 1,000 requests are exempt)."""
        report = self.report
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

    def check_memory(self) -> None:
        """Every sample after the first tenth within the limits of the one that ends it, no Request alive
        at any sample, little heap retained over each traced window; one message per measure, at its worst."""
        report = self.report
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
                                     ("heap blocks", lambda s: s.heap_blocks - baseline.heap_blocks,
                                      MAX_BLOCK_GROWTH)):
            worst = max(later, key=measure, default=None)
            if worst is not None and measure(worst) > limit:
                report.problem(f"memory: {measure(worst):+,} {name} since the first tenth, after "
                               f"{worst.requests_done:,} requests (limit +{limit})", kind="memory")
        for heap in report.heap_windows:
            if heap.retained_bytes > MAX_HEAP_RETAINED:
                report.problem(f"heap: {heap.retained_bytes / 1024:+.1f} KiB retained over requests "
                               f"{heap.first_request:,}-{heap.first_request + heap.requests:,} "
                               f"(limit {MAX_HEAP_RETAINED // 1024} KiB)", kind="memory")


def run_simulation(settings: SimulationSettings, tamper: Callable[[int, Engine], None] | None = None,
                   progress: Callable[[SimulationReport], None] | None = None) -> SimulationReport:
    return Simulation(settings, tamper, progress).run()
