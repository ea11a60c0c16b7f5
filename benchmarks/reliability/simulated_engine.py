"""One phase's engine for the simulation: the real EngineCore, its KV manager and the model-free executor,
with the shadow KV the simulated model writes."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

from benchmarks.reliability.shadow_kv import ShadowKV
from benchmarks.reliability.simulation_report import Phase
from pagedllm.engine.core import EngineCore
from pagedllm.engine.executor.model_free_executor import ModelFreeExecutor
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv.manager import KVCacheManager
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.model_free_runner import ModelFreeRunner


class ObservedExecutor(ModelFreeExecutor):
    """The model-free executor, showing the simulation each step's plan before the runner applies it."""

    def __init__(self, runner: ModelFreeRunner, observe: Callable[[SchedulerOutput], None]):
        super().__init__(runner)
        self.observe = observe

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.observe(scheduler_output)
        return super().execute_model(scheduler_output)


class Engine:
    """One phase's engine core (with its KV manager and the model-free executor) and shadow KV, kept for the
    whole run."""

    def __init__(self, phase: Phase, sample: Callable[..., ModelRunnerOutput],
                 observe: Callable[[Engine, SchedulerOutput], None]):
        """sample(engine, batch, rows, num_new, sampling_rows): the runner's tokens (see ModelFreeRunner);
        observe(engine, plan): sees each step's plan before the runner applies it."""
        self.phase = phase
        self.kv = KVCacheManager(phase.num_blocks, phase.block_size, phase.enable_prefix_caching)
        # Rows for twice max_num_seqs (forks join beyond it), so the batch's arrays are not still growing
        # to their high-water mark in a traced window.
        self.runner = ModelFreeRunner(phase.max_model_len, phase.block_size, partial(sample, self),
                                      capacity=2 * phase.max_num_seqs)
        self.core = EngineCore(ObservedExecutor(self.runner, partial(observe, self)), self.kv,
                               phase.max_num_seqs, phase.max_num_batched_tokens, phase.enable_chunked_prefill,
                               phase.policy)
        self.shadow = ShadowKV(phase.num_blocks, phase.block_size)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler
