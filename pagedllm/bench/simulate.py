"""The engine's scheduler, KV manager and worker batch driven without a model, for memory and overhead figures.

Every request runs to its max_tokens (as with ignore_eos), each sampled token is a
placeholder: what is measured is bookkeeping, which does not depend on token values.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.bench.workload import BenchRequest
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv.manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.step import ModelRunnerOutput
from pagedllm.worker.model_free_runner import ModelFreeRunner


@dataclass
class SimulationResult:
    steps: int = 0
    peak_running: int = 0
    used_slots: int = 0           # summed over steps: used blocks * block_size
    stored_tokens: int = 0        # summed over steps: tokens in the KV cache
    running_seq_steps: int = 0    # summed over steps: running sequences
    oracle_slots: int = 0         # summed over steps: prompt + max_tokens of each running sequence
    preemptions: int = 0
    step_seconds: list[float] = field(default_factory=list)   # schedule, batch update, update_from_output

    @property
    def utilization(self) -> float:
        """Time-averaged tokens stored / slots in allocated blocks."""
        return self.stored_tokens / self.used_slots if self.used_slots else 1.0

    def reserved_utilization(self, reserved_tokens_per_seq: int) -> float:
        """The same tokens over a contiguous reservation of a fixed length per sequence."""
        return self.stored_tokens / (self.running_seq_steps * reserved_tokens_per_seq)

    @property
    def oracle_utilization(self) -> float:
        """The same tokens over a reservation of exactly prompt + max_tokens per sequence."""
        return self.stored_tokens / self.oracle_slots


def _placeholder_tokens(batch, rows, num_new, sampling_rows) -> ModelRunnerOutput:
    count = len(sampling_rows)
    return ModelRunnerOutput([batch.req_ids[row] for row in sampling_rows.tolist()], [0] * count, [0.0] * count)


def simulate(workload: list[BenchRequest], num_blocks: int, block_size: int, max_num_seqs: int = 256,
             max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
             on_step: Callable[[KVCacheManager, Scheduler], None] | None = None) -> SimulationResult:
    """Runs the workload to the end; on_step (a trace, say) sees the KV manager and scheduler after each step."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    scheduler = Scheduler(kv, max_num_seqs, max_num_batched_tokens)
    max_model_len = max(len(item.prompt_token_ids) + item.max_tokens for item in workload)
    runner = ModelFreeRunner(max_model_len, block_size, _placeholder_tokens)
    for index, item in enumerate(workload):
        params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
        scheduler.add_request(Request(str(index), item.prompt_token_ids, params, (), item.max_tokens,
                                      arrival_time=float(index)))
    result = SimulationResult()
    while scheduler.has_unfinished_requests():
        started = time.perf_counter()
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, runner.execute_model(plan))
        result.step_seconds.append(time.perf_counter() - started)
        usage = kv.usage()
        result.steps += 1
        result.peak_running = max(result.peak_running, len(scheduler.running))
        result.used_slots += usage.num_used_blocks * block_size
        result.stored_tokens += usage.num_tokens_stored
        result.running_seq_steps += len(scheduler.running)
        result.oracle_slots += sum(r.num_prompt_tokens + r.max_tokens for r in scheduler.running)
        result.preemptions += len(plan.preempted_req_ids)
        if on_step is not None:
            on_step(kv, scheduler)
    return result
