"""Days of traffic, simulated: the real EngineCore (Scheduler, KVCacheManager, BlockPool) stepped with the
model-free executor.

Why: a block allocator that fragments or leaks is what makes "restart after 24 h" advice necessary. This
run pushes up to millions of requests through the real bookkeeping: random prompt and output lengths,
shared prefixes and repeated prompts (prefix-cache hits), per-tenant cache salts, n > 1 parallel
samples forked from one prefill, beam search forking and dropping beams, aborts while waiting,
mid-prefill and mid-decode, storms that exhaust the pool, and pools from 16 blocks to 8,192. It checks
that nothing is left behind and nothing is mixed up (simulation_checks.py lists how).

Sampled tokens are random ids: bookkeeping does not depend on their meaning, and distinct ids keep the
prefix cache honest (only shared prefixes and repeated prompts hit).
"""
from __future__ import annotations

import gc
import random
import time
import tracemalloc
from array import array
from typing import Callable

import numpy as np

from benchmarks.reliability.simulated_engine import Engine
from benchmarks.reliability.simulation_checks import (HeapTracer, check_coverage, check_idle, check_memory,
                                                      check_mid_run, evict_all, measure_memory, release_capacity)
from benchmarks.reliability.simulation_report import MemorySample, SimulationReport, SimulationSettings
from benchmarks.reliability.simulation_workload import EOS, PARAMS, STOP, VOCAB, Job, Workload
from pagedllm.engine.beam_search import BeamSearch, BeamSearchParams
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.step import ModelRunnerOutput, SchedulerOutput

# Steps without a single sampled token before the engine counts as stuck: the longest prefill here
# (2,048 tokens at 64 a step) takes 32, so this leaves room for heavy preemption yet ends a livelock.
MAX_STEPS_WITHOUT_SAMPLE = 1000


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
        self.plan: SchedulerOutput | None = None     # the current step's, once the executor has it
        self.forked: list[Request] = []              # what the current step's plan will change
        self.beams_before: dict[Job, list[Request]] = {}
        self.prefill_aborts: list[Job] = []
        self.failed = False                  # a structural check failed: stop, the state is unreliable

    def run(self) -> SimulationReport:
        settings, report = self.settings, self.report
        started = time.perf_counter()
        # What the process held before (torch, a test session...) goes to the collector's permanent
        # generation: collections and the object census then see only the run's own objects, and cost
        # milliseconds instead of a second in a big process. Unfrozen at the end.
        gc.collect()
        gc.freeze()
        self.engines = [Engine(phase, self.sample, self.before_step) for phase in settings.phases]
        size = settings.segment_size()
        num_segments = -(-settings.requests // size)
        report.memory_samples = array("q", bytes(8 * len(MemorySample._fields) * num_segments))
        windows = HeapTracer.windows(settings.trace_heap, len(settings.phases), num_segments)
        tracer = HeapTracer(report)
        try:
            for segment in range(num_segments):
                if self.failed:
                    break
                if segment in windows:
                    tracer.start()
                engine = self.engines[segment % len(self.engines)]
                self.run_segment(engine, min(size, settings.requests - report.requests))
                self.end_segment(engine)
                if tracemalloc.is_tracing() and segment + 1 in windows.values():
                    tracer.stop()
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
            check_coverage(report)
            check_memory(report)
        report.wall_seconds = time.perf_counter() - started
        return report

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
                self.submit(engine, jobs[arrived])
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

    def submit(self, engine: Engine, job: Job) -> None:
        """Hands a job's requests to the engine core, built as the input processor builds them from token ids:
        one request, its parallel siblings to be forked from it, or a beam search's first beam."""
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
            engine.core.add_request(job.search.first_request)
            return
        arrival = self.tick()
        first = self.new_request(job, f"r{self.next_id}", arrival)
        job.live.append(first)
        if job.kind == "parallel":
            report.parallel_requests += 1
            job.pending = [self.new_request(job, f"r{self.next_id}.{index}", arrival)
                           for index in range(1, job.width)]
        engine.core.add_request(first, job.pending)

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
        """One EngineCore step: it schedules, its executor shows the plan to before_step and lets the runner
        apply it to its batch and "sample" (self.sample writes the shadow KV through the runner's own block
        tables), and it applies the output; then the simulation's own records catch up. False when the
        scheduler did nothing although requests are unfinished."""
        self.plan = None
        try:
            step = engine.core.step()
            plan = self.plan
            if plan is None or not plan.num_scheduled_tokens:   # e.g. a request that preempted itself
                self.steps_without_sample += 1
                return plan is not None and bool(plan.preempted_req_ids)
            self.steps_without_sample = 0 if step.runner_output.req_ids else self.steps_without_sample + 1
            self.catch_up(step.sampled, self.forked, self.beams_before)
            for job in self.prefill_aborts:
                if job.sequences():
                    self.abort(engine, job)
        except Exception as exc:   # noqa: BLE001 - any exception from the engine is a finding
            self.fail([f"{type(exc).__name__}: {exc}"], f"step {self.step} ({engine.phase.name})")
            return True
        finally:   # no Request outlives its step here: the memory census counts them
            self.plan, self.forked, self.beams_before, self.prefill_aborts = None, [], {}, []
        if self.step % self.settings.check_every_steps == 0:
            self.report.mid_run_checks += 1
            self.fail(check_mid_run(engine.scheduler), f"step {self.step} ({engine.phase.name}), mid-run")
        if self.tamper is not None:
            self.tamper(self.step, engine)
        return True

    def before_step(self, engine: Engine, plan: SchedulerOutput) -> None:
        """The executor's view of a step before the runner applies it: counts it, applies its block copies
        to the shadow KV, and notes what its output will change (forks, beams, prefills to abort)."""
        self.plan = plan
        if not plan.num_scheduled_tokens:
            return
        scheduler, report = engine.scheduler, self.report
        self.step += 1
        report.steps += 1
        if plan.block_copies:
            report.block_copies += len(plan.block_copies)
            engine.shadow.copy(plan.block_copies)
        self.forked = [scheduler.requests[request.request_id] for request in plan.scheduled_new_reqs
                       if request.sample_with is not None]
        report.forks += len(self.forked)
        self.beams_before = {job: job.sequences() for job in self.beam_jobs_in(scheduler, plan)}
        self.prefill_aborts = self.jobs_left_mid_prefill(scheduler, plan)

    def beam_jobs_in(self, scheduler: Scheduler, plan) -> list[Job]:
        jobs = []
        for request_id in plan.num_scheduled_tokens:
            search = scheduler.requests[request_id].beam_search
            if search is not None and self.searches[search] not in jobs:
                jobs.append(self.searches[search])
        return jobs

    def jobs_left_mid_prefill(self, scheduler: Scheduler, plan) -> list[Job]:
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
        requests, random_ = engine.scheduler.requests, self.rng.random
        self.write_shadow(engine, batch, rows, num_new)
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

    def write_shadow(self, engine: Engine, batch, rows: np.ndarray, num_new: np.ndarray) -> None:
        """Writes the step's computed tokens to the shadow KV through the runner's own block tables, decodes
        (one token each, first among the rows) in one gather; a prefill that ends reads back. Reads only the
        entries written, bounded by each row's own counts as a whole-row read would be: a wrong step delta
        (a short table, a missing token) still raises, or writes where it points."""
        shadow, requests, size = engine.shadow, engine.scheduler.requests, engine.shadow.block_size
        starts = batch.num_computed_tokens[rows]
        decoding = num_new == 1
        decode_rows, decode_starts = rows[decoding], starts[decoding]
        block_indices = decode_starts // size
        if not ((decode_starts < batch.num_tokens[decode_rows]).all()
                and (block_indices < batch.num_blocks[decode_rows]).all()):
            raise IndexError("the runner's batch lacks a decoding row's token or block-table entry")
        block_ids = batch.block_table[decode_rows, block_indices]
        shadow.write_decodes((block_ids * size + decode_starts % size).tolist(), block_ids.tolist(),
                             batch.token_ids[decode_rows, decode_starts].tolist(),
                             [requests[batch.req_ids[row]].cache_salt for row in decode_rows.tolist()])
        prefilling = ~decoding
        for row, start, count in zip(rows[prefilling].tolist(), starts[prefilling].tolist(),
                                     num_new[prefilling].tolist()):
            request = requests[batch.req_ids[row]]
            end, first_block, num_tokens = start + count, start // size, int(batch.num_tokens[row])
            table = batch.block_table[row, first_block:min(-(-end // size), int(batch.num_blocks[row]))].tolist()
            shadow.write(table, first_block, batch.token_ids[row, start:min(end, num_tokens)].tolist(), start,
                         request.cache_salt)
            if end == num_tokens:   # a prefill just ended: prefix hits must read back
                self.read_back(engine, request, end)

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
        if not engine.shadow.reads_back(request.request_id, block_ids, request.all_token_ids, count,
                                        request.cache_salt):
            self.fail([f"{request.request_id} reads back other tokens (or another salt's) than its own through "
                       f"its block table ({count} computed tokens, table {block_ids})"],
                      f"step {self.step} ({engine.phase.name}), shadow KV")

    def forget(self, request: Request) -> None:
        job = self.owner.pop(request.request_id)
        self.stop_at.pop(request.request_id)
        job.live.remove(request)

    def abort(self, engine: Engine, job: Job) -> None:
        """A client's abort: every unfinished sequence of the job ends in the engine core, wherever it is, after
        a last read-back through its table."""
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
        engine.core.abort_requests(job.live + job.pending)   # pending: never forked, nothing to free
        for request in list(job.live):
            self.forget(request)
        for request in job.pending:
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

    def idle_point(self, engine: Engine) -> None:
        """Checks that nothing is left; first the step that tells the runner of the last finished requests
        (the engine sends it with the next step), which must schedule nothing and empty the runner's batch."""
        self.report.idle_points += 1
        self.plan = None
        engine.core.step()
        plan, self.plan = self.plan, None
        problems = check_idle(engine.scheduler, (engine.core, "the engine core"))
        if plan is not None and plan.num_scheduled_tokens:
            problems.append(f"an idle scheduler scheduled {len(plan.num_scheduled_tokens)} requests")
        batch = engine.runner.input_batch
        if batch.req_ids or batch.row_of or batch.generators:
            problems.append(f"the runner's batch still holds {len(batch.req_ids)} rows")
        if self.owner or self.stop_at or self.searches:
            problems.append(f"the simulation itself still tracks {len(self.owner) + len(self.searches)} sequences")
        self.fail(problems, f"idle point after step {self.step} ({engine.phase.name})")
        engine.shadow.forget()

    def end_segment(self, engine: Engine) -> None:
        """Evicts the segment's cached blocks, releases spare capacity and takes a memory sample."""
        if self.failed:
            return
        self.fail(evict_all(engine.kv.pool), f"segment end ({engine.phase.name})")
        engine.shadow.clear()
        self.workload.recent.clear()
        release_capacity([self, self.workload, self.report] + [owner for e in self.engines for owner in (
            e.kv, e.kv.pool, e.scheduler, e.core, e.runner.input_batch, e.shadow)])
        self.report.record_memory(measure_memory(self.report.requests))


def run_simulation(settings: SimulationSettings, tamper: Callable[[int, Engine], None] | None = None,
                   progress: Callable[[SimulationReport], None] | None = None) -> SimulationReport:
    return Simulation(settings, tamper, progress).run()

