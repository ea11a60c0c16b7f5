"""What the engine calls on its workers, whichever way they run."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.model.loader import Checkpoint
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.worker import Worker, WorkerArgs


class Executor(ABC):
    """Runs worker methods on every rank. `driver_worker` is rank 0, in the engine process: its runner
    is the engine's `runner`, and results (sampled tokens) come from it."""

    driver_worker: Worker

    @staticmethod
    def create(args: WorkerArgs, checkpoint: Checkpoint) -> Executor:
        from pagedllm.engine.executor.multiproc_executor import MultiprocExecutor
        from pagedllm.engine.executor.uniproc_executor import UniProcExecutor

        executor_class = MultiprocExecutor if args.engine_config.tensor_parallel_size > 1 else UniProcExecutor
        return executor_class(args, checkpoint)

    @abstractmethod
    def collective_rpc(self, method: str, *args, **kwargs):
        """getattr(worker, method)(*args, **kwargs) on every rank; returns rank 0's result."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", scheduler_output)

    @abstractmethod
    def check_health(self) -> None:
        """Raises if a rank is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops every rank; idempotent."""
