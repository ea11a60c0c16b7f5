"""Tensor parallelism over processes: rank 0 in the engine process, ranks 1.. spawned.

Each call is pickled once and written to every worker's pipe; every rank runs it (the forward pass
meets in the model's collectives), and the workers answer on their pipes when done. A worker that
dies is seen at once: a monitor thread watches the processes and stops the other workers, so
that rank 0's collective fails on closed sockets instead of waiting, and every later call raises.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from pagedllm.distributed.parallel_state import get_open_port
from pagedllm.engine.executor.abstract import Executor
from pagedllm.model.loader import Checkpoint
from pagedllm.model.quantization import GGUF_QUANTIZED_TYPES
from pagedllm.model.tensor_parallel import check_tensor_parallel_size
from pagedllm.worker.worker import Worker, WorkerArgs, run_worker_process

logger = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 10   # a worker told to stop that has not exited by then is killed
DEATH_NOTICE_SECONDS = 5    # upper bound on naming a dying worker as the cause of a failed call
_SHUTDOWN = pickle.dumps(None)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone (or failed); the engine cannot step any more."""


@dataclass
class WorkerProcess:
    rank: int
    process: multiprocessing.Process
    conn: Connection


@dataclass
class Failure:
    """The first failure seen, shared by the executor and its monitor thread."""
    reason: str | None = None


class MultiprocExecutor(Executor):
    def __init__(self, args: WorkerArgs, checkpoint: Checkpoint):
        tp_size = args.engine_config.tensor_parallel_size
        check_tensor_parallel_size(checkpoint.config, tp_size, _row_parallel_weights_quantized(args, checkpoint))
        if args.device.type == "cuda" and torch.cuda.device_count() < tp_size:
            raise ValueError(f"tensor_parallel_size ({tp_size}) must be at most the number of CUDA devices "
                             f"({torch.cuda.device_count()})")
        threads = max(1, torch.get_num_threads() // tp_size)
        args = dataclasses.replace(args, num_threads=threads, port=get_open_port())
        logger.info("tensor parallel: %d ranks (%s), %d torch thread(s) each", tp_size,
                    "NCCL" if args.device.type == "cuda" else "gloo on 127.0.0.1", threads)
        context = multiprocessing.get_context("spawn")
        self.workers: list[WorkerProcess] = []
        self.failure = Failure()
        monitor_wake, self._monitor_stop = context.Pipe(duplex=False)
        self._driver: list[Worker] = []   # rank 0, once built: the finalizer's, not the executor's, reference
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self._monitor_stop, self._driver)
        try:
            for rank in range(1, tp_size):
                parent_end, child_end = context.Pipe()
                process = context.Process(target=run_worker_process, args=(args, rank, child_end),
                                          name=f"pagedllm-tp-rank{rank}", daemon=True)
                process.start()
                child_end.close()
                self.workers.append(WorkerProcess(rank, process, parent_end))
            self.driver_worker = Worker(args, rank=0, checkpoint=checkpoint)
            self._driver.append(self.driver_worker)
            for worker in self.workers:
                _reply(worker, "start-up")
            self._monitor = threading.Thread(target=_monitor, args=(self.workers, monitor_wake, self.failure),
                                             name="pagedllm-tp-monitor", daemon=True)
            self._monitor.start()
            self.collective_rpc("init_distributed")
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str, *args, **kwargs):
        self.check_health()
        payload = pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for worker in self.workers:
                worker.conn.send_bytes(payload)
            result = getattr(self.driver_worker, method)(*args, **kwargs)
            for worker in self.workers:
                _reply(worker, method)
        except Exception as exc:
            # A peer's sockets close as it exits, a moment before it can be reaped: let its death show.
            wait([worker.process.sentinel for worker in self.workers], timeout=DEATH_NOTICE_SECONDS)
            reason = self.failure.reason or _dead_worker(self.workers) or f"{method} failed: {exc}"
            self.failure.reason = reason
            _kill_alive(self.workers)   # ranks still in the collective would wait for the dead one
            self.shutdown()
            raise WorkerDiedError(f"tensor-parallel engine stopped: {reason}") from exc
        return result

    def check_health(self) -> None:
        reason = self.failure.reason or _dead_worker(self.workers)
        if reason is not None:
            self.failure.reason = reason
            raise WorkerDiedError(f"tensor-parallel engine stopped: {reason}")

    def shutdown(self) -> None:
        self._finalizer()


def _row_parallel_weights_quantized(args: WorkerArgs, checkpoint: Checkpoint) -> bool:
    """Whether o_proj/down_proj stay group-quantized, so each rank must get whole groups of their columns."""
    if args.engine_config.quantization == "none":
        return False
    return any(kind in GGUF_QUANTIZED_TYPES or kind in ("int8", "int4")
               for name, kind in checkpoint.weights.formats.items()
               if name.endswith(("o_proj.weight", "down_proj.weight")))


def _reply(worker: WorkerProcess, what: str) -> None:
    """Waits for the worker's answer to the last call; raises if it failed or died meanwhile."""
    wait([worker.conn, worker.process.sentinel])
    try:
        kind, detail = worker.conn.recv()
    except (EOFError, OSError):
        raise WorkerDiedError(_dead_worker([worker]) or f"rank {worker.rank} closed its pipe") from None
    if kind == "error":
        raise WorkerDiedError(f"rank {worker.rank} failed in {what}:\n{detail}")


def _dead_worker(workers: list[WorkerProcess]) -> str | None:
    for worker in workers:
        if not worker.process.is_alive():
            return (f"worker rank {worker.rank} (pid {worker.process.pid}) exited with code "
                    f"{worker.process.exitcode}")
    return None


def _monitor(workers: list[WorkerProcess], stop: Connection, failure: Failure) -> None:
    """Waits for a worker to exit (or to be told to stop); a worker's exit stops the others, which breaks
    any collective rank 0 is in, and records why. Holds no reference to the executor, so it can be freed."""
    sentinels = {worker.process.sentinel: worker for worker in workers}
    ready = wait([stop, *sentinels])
    if stop in ready:
        return
    failure.reason = failure.reason or _dead_worker(workers)
    logger.error("tensor parallel: %s; stopping the other ranks", failure.reason)
    _kill_alive(workers)


def _kill_alive(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()


def _stop_workers(workers: list[WorkerProcess], monitor_stop: Connection, driver: list[Worker]) -> None:
    """Stops the monitor, asks each worker to exit, kills any that do not, and has rank 0 leave the group.
    Runs once: on shutdown(), when the executor is freed, or at interpreter exit."""
    try:
        monitor_stop.send(None)
    except OSError:   # the monitor never started
        pass
    for worker in workers:
        try:
            worker.conn.send_bytes(_SHUTDOWN)
        except OSError:
            pass
    for worker in workers:
        worker.process.join(STOP_TIMEOUT_SECONDS)
        if worker.process.is_alive():
            logger.warning("tensor parallel: rank %d did not stop in %ds; killing it", worker.rank,
                           STOP_TIMEOUT_SECONDS)
            worker.process.kill()
            worker.process.join()
        worker.conn.close()
    for worker in driver:
        worker.shutdown()
