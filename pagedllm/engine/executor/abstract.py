"""What the engine calls on its workers, whichever way they run."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.worker import Worker


class Executor(ABC):
    """Runs worker methods on every rank. `driver_worker` is rank 0, in the engine process: its runner
    is the engine's `runner`, and results (sampled tokens) come from it."""

    driver_worker: Worker

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
