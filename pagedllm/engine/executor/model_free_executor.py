"""An executor without a model: the engine core steps the worker-side bookkeeping of a ModelFreeRunner (the
real InputBatch, tokens from a callback), for the model-free simulations and scheduler tests."""
from __future__ import annotations

from pagedllm.engine.executor.abstract import Executor
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.model_free_runner import ModelFreeRunner


class ModelFreeExecutor(Executor):
    """One rank, in process, with no worker: `runner` takes every call."""

    def __init__(self, runner: ModelFreeRunner):
        self.runner = runner

    def collective_rpc(self, method: str, *args, **kwargs):
        return getattr(self.runner, method)(*args, **kwargs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
