"""Which executor an engine gets: its workers in process, or tensor-parallel ranks in spawned processes."""
from __future__ import annotations

from pagedllm.engine.executor.abstract import Executor
from pagedllm.engine.executor.multiproc_executor import MultiprocExecutor
from pagedllm.engine.executor.uniproc_executor import UniProcExecutor
from pagedllm.model.loader import Checkpoint
from pagedllm.worker.worker import WorkerArgs


def create_executor(args: WorkerArgs, checkpoint: Checkpoint) -> Executor:
    """MultiprocExecutor for tensor_parallel_size > 1, UniProcExecutor otherwise."""
    executor_class = MultiprocExecutor if args.engine_config.tensor_parallel_size > 1 else UniProcExecutor
    return executor_class(args, checkpoint)
