"""The simulation's settings (its phases: pool sizes and scheduler knobs) and its report: the figures a run
gathers, the problems it found, and the table it prints."""
from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

# Allowed growth from the sample that ends the first tenth of the run to any later one, and heap
# retained over a traced cycle. Samples are taken at idle points with every container's spare
# capacity released (release_capacity), so a leak-free run stays within a few objects; a leak of one
# object per thousand requests would pass 900 over a million.
MAX_OBJECT_GROWTH = 100          # gc-tracked objects
MAX_BLOCK_GROWTH = 500           # live heap blocks (sys.getallocatedblocks: ints, bytes, str included)
MAX_HEAP_RETAINED = 64 * 1024    # bytes retained over one traced cycle (30,000 requests in a million)
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


