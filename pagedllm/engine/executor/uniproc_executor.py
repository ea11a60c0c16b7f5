"""The single worker in the engine's own process (tensor_parallel_size 1)."""
from __future__ import annotations

from pagedllm.engine.executor.abstract import Executor
from pagedllm.model.loader import Checkpoint
from pagedllm.worker.worker import Worker, WorkerArgs


class UniProcExecutor(Executor):
    def __init__(self, args: WorkerArgs, checkpoint: Checkpoint):
        self.driver_worker = Worker(args, rank=0, checkpoint=checkpoint)

    def collective_rpc(self, method: str, *args, **kwargs):
        return getattr(self.driver_worker, method)(*args, **kwargs)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
