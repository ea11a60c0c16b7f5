"""EngineCore: the scheduler, the KV manager and an executor stepped together on plain step data.

It knows no text: requests come in built (engine/input_processor.py) and sampled tokens go out to the output
processor. The executor is passed in, so the same core runs a model's workers, tensor-parallel ranks, the
model-free runner of the simulations or a fault-injecting wrapper (vLLM v1's EngineCore).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.config import SpeculativeConfig
from pagedllm.engine.executor.abstract import Executor
from pagedllm.engine.lora_adapters import adapter_names, adapters_in_step
from pagedllm.engine.preemption import PreemptionPolicy
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.stats import EngineStats, KVDiskStats, KVSwapStats, StepStats
from pagedllm.kv.manager import KVCacheManager
from pagedllm.spec_decode.planner import SpeculationPlanner
from pagedllm.step import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class CoreStep:
    """What one step did: the (request, output row) of each token the scheduler appended, the runner's output
    (None when nothing ran), and the requests that failed before they could run."""
    sampled: list[tuple[Request, int]]
    runner_output: ModelRunnerOutput | None
    failed: list[Request]


class EngineCore:
    def __init__(self, executor: Executor, kv_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True, scheduling_policy: str = "fcfs",
                 structured_output=None, speculative_config: SpeculativeConfig | None = None,
                 max_loras: int | None = None, preemption_mode: str = "auto", kv_block_bytes: int = 0):
        """structured_output: a StructuredOutputManager, when requests may carry grammars; max_loras: the most
        LoRA adapters a step may run (None: LoRA off); preemption_mode: how a preempted request gives back its
        blocks when the KV manager has a swap space (without one every preemption recomputes); kv_block_bytes:
        one block's bytes on one rank, for the swap figures."""
        self.executor = executor
        self.kv_manager = kv_manager
        self.kv_block_bytes = kv_block_bytes
        self.preemption = PreemptionPolicy(preemption_mode) if kv_manager.swap is not None else None
        speculation = SpeculationPlanner(speculative_config) if speculative_config is not None else None
        self.scheduler = Scheduler(kv_manager, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
                                   scheduling_policy, structured_output, speculation, max_loras, self.preemption)
        self.structured_output = structured_output
        self.last_step_stats: StepStats | None = None
        # Called on the engine thread with each step's StepStats (the dashboard subscribes while a page is open).
        self.step_listeners: list[Callable[[StepStats], None]] = []
        # Hooks for test tooling (the reliability suite's fault injection), so that it needs no patching: each
        # request listener sees every request queued, with its siblings; each step gate is asked before a step
        # whether it may run. A shut gate skips the step (the gate itself decides how long to wait first);
        # calls made between steps, aborts and stats, still go through.
        self.request_listeners: list[Callable[[Request, list[Request]], None]] = []
        self.step_gates: list[Callable[[], bool]] = []

    def add_request(self, request: Request, siblings: list[Request] = ()) -> None:
        """Queues a request; `siblings` (its other parallel samples) are forked from it when it first samples."""
        self.scheduler.add_request(request, siblings)
        for listener in self.request_listeners:
            listener(request, siblings)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Ends a request wherever it is; its blocks return to the pool at once."""
        self.scheduler.finish(request, status)

    def abort_requests(self, requests: list[Request]) -> None:
        for request in requests:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def step(self) -> CoreStep:
        """Schedules a batch, runs it on the executor and applies its output (nothing while a step gate is shut)."""
        if not all(gate() for gate in self.step_gates):
            return CoreStep([], None, [])
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        failed, self.scheduler.failed_requests = self.scheduler.failed_requests, []
        if not scheduler_output.has_work:
            if not failed:
                self._wait_for_grammars()
            return CoreStep([], None, failed)
        num_loras = 0 if self.scheduler.max_loras is None else adapters_in_step(scheduler_output,
                                                                                 self.scheduler.requests)
        scheduled = time.perf_counter()
        runner_output = self.executor.execute_model(scheduler_output)
        computed = time.perf_counter()
        sampled = self.scheduler.update_from_output(scheduler_output, runner_output)
        updated = time.perf_counter()
        self.last_step_stats = StepStats(
            scheduling_seconds=(scheduled - started) + (updated - computed),
            prepare_seconds=runner_output.prepare_seconds,
            model_seconds=computed - scheduled - runner_output.prepare_seconds,
            num_seqs=len(scheduler_output.num_scheduled_tokens),
            num_tokens=scheduler_output.total_num_scheduled_tokens,
            num_preemptions=len(scheduler_output.preempted_req_ids),
            block_copies=scheduler_output.block_copies,
            num_loras=num_loras,
        )
        if self.preemption is not None:
            self._observe_preemption_costs(scheduler_output, runner_output)
        for listener in self.step_listeners:
            listener(self.last_step_stats)
        return CoreStep(sampled, runner_output, failed)

    def _observe_preemption_costs(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Feeds preemption_mode auto the step's measured costs: seconds per prefill token (a step of mostly
        prefill tokens) and seconds per swapped block copied."""
        step, work = self.last_step_stats, scheduler_output.disk_work
        self.preemption.observe_swap(len(work.swap_outs) + len(work.swap_ins), runner_output.kv_swap_seconds)
        if step.num_tokens >= 2 * step.num_seqs:
            self.preemption.observe_prefill(step.num_tokens, step.model_seconds - runner_output.kv_swap_seconds)

    def _wait_for_grammars(self, timeout: float = 0.05) -> None:
        """Nothing could run: if requests wait for their grammars to compile, wait for one rather than spin."""
        compiling = [request.grammar for request in self.scheduler.waiting if request.grammar is not None]
        if compiling:
            self.structured_output.wait_for_compiles(compiling, timeout)

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(kv_cache=self.kv_manager.usage(), num_running=len(scheduler.running),
                           num_waiting=len(scheduler.waiting), num_preemptions=scheduler.num_preemptions,
                           last_step=self.last_step_stats,
                           spec_decoding=spec.snapshot() if (spec := scheduler.spec_decoding_stats) else None,
                           kv_disk=self._kv_disk_stats(), kv_swap=self._kv_swap_stats(),
                           running_lora_adapters=adapter_names(scheduler.running),
                           waiting_lora_adapters=adapter_names(scheduler.waiting),
                           max_lora=scheduler.max_loras or 0)

    def _kv_disk_stats(self) -> KVDiskStats | None:
        disk = self.kv_manager.disk
        if disk is None:
            return None
        bytes_read, bytes_written, stale_files_removed = self.executor.collective_rpc("kv_disk_bytes_moved")
        counters = disk.counters
        return KVDiskStats(len(disk), disk.capacity_blocks, counters.hits, counters.read_failures, counters.spills,
                           counters.evictions, bytes_read, bytes_written, stale_files_removed)

    def _kv_swap_stats(self) -> KVSwapStats | None:
        swap = self.kv_manager.swap
        if swap is None:
            return None
        counters, block_bytes = swap.counters, self.kv_block_bytes
        return KVSwapStats(swap.tier, swap.capacity_blocks, swap.num_blocks, counters.swap_outs, counters.swap_ins,
                           counters.blocks_out, counters.blocks_in, counters.blocks_reused,
                           counters.blocks_out * block_bytes,
                           counters.blocks_in * block_bytes, counters.refused, counters.failed_blocks,
                           self.preemption.counters.recomputed)

    def flush_kv_disk_tier(self) -> None:
        """Returns once every block spilled so far is written (tests, and a clean shutdown)."""
        if self.kv_manager.disk is not None:
            self.executor.collective_rpc("flush_kv_disk_tier")

    def shutdown(self) -> None:
        """Writes out the disk tier and stops the executor's workers."""
        self.flush_kv_disk_tier()
        self.executor.shutdown()
