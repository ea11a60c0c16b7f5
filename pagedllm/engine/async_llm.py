"""AsyncLLM: an asyncio front over LLMEngine, for servers with many concurrent callers.

The engine is not thread-safe and its steps block for as long as the model
computes, so every engine call (add_request, abort_request, step) runs on one
dedicated worker thread: a single-thread executor serialises them in the order
they were submitted, and the event loop stays free to serve HTTP meanwhile.
One background task drives the steps and routes each RequestOutput by
request_id to its caller's asyncio.Queue; it sleeps while the engine is idle.

One AsyncLLM belongs to one event loop (its queues and event bind to it).

With max_waiting_requests, a new request is refused at once (EngineOverloadedError)
while that many wait: those handed to the engine thread plus the scheduler's waiting queue.
A request passes from the first count to the second under a lock, so it is never counted
twice or not at all; the check and the count run on the event loop with no await between
them, so the bound is strict.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from pagedllm.config import EngineConfig
from pagedllm.engine.input_processor import CheckedPrompt, PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.protocol import EngineClient, EngineDeadError, EngineRequestError, LocalEngine
from pagedllm.engine.stats import EngineStats
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class _StepFailed(Exception):
    """Raised on the engine thread when a whole step failed; names the requests it aborted."""

    def __init__(self, failed_ids: list[str]):
        super().__init__(f"step failed; aborted {len(failed_ids)} requests")
        self.failed_ids = failed_ids


# Put in a request's queue by abort(): its stream ends without a finished output.
_ABORTED = None


class AsyncLLM(EngineClient, LocalEngine):
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None):
        self.engine = engine
        self.config, self.tokenizer, self.model_config = engine.config, engine.tokenizer, engine.model_config
        self.max_model_len, self.pooling = engine.max_model_len, engine.pooling
        self.max_waiting_requests = max_waiting_requests
        self._num_adding = 0   # requests handed to the engine thread and not yet in the scheduler's queue
        # Held while a request moves from _num_adding into the scheduler's queue, and while both are read.
        # Reentrant: a request listener on the engine thread may read the count during the move.
        self._adding_lock = threading.RLock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-engine")
        self._streams: dict[str, asyncio.Queue] = {}
        self._new_work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._dead: EngineDeadError | None = None   # set, new and in-flight requests fail with it
        self._closed = False                          # set by shutdown(): the engine thread is gone

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting_requests: int | None = None) -> AsyncLLM:
        """Loads the model (blocking: call it before serving) and wraps the engine."""
        return cls(LLMEngine(config), max_waiting_requests)

    @property
    def num_waiting_requests(self) -> int:
        """Requests not yet running: being added, or in the scheduler's waiting queue (a list whose
        length is safe to read from this thread while the engine thread changes it)."""
        with self._adding_lock:
            return self._num_adding + len(self.engine.scheduler.waiting)

    def check_prompt(self, prompt: PromptType, params: SamplingParams) -> CheckedPrompt:
        """The engine's own check: the tokenizer and fixed limits only, safe off the engine thread."""
        return self.engine.check_prompt(prompt, params)

    def check_pooling_prompt(self, prompt: PromptType, params: PoolingParams) -> tuple[list[int], list[int]]:
        return self.engine.check_pooling_prompt(prompt, params)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as the engine makes them, as sampling_params.output_kind asks,
        ending after the finished one.

        Raises ValueError for a request that can never run, EngineOverloadedError when
        max_waiting_requests wait already, EngineRequestError when the engine fails it,
        EngineDeadError after shutdown(). A stream ended by abort() just stops, with no finished
        output. Closing or cancelling the iterator aborts the request, freeing its KV blocks.
        """
        if self._dead is not None:
            raise self._dead
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_capacity()
        self._start_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        done = False   # True once the engine holds nothing more of this request
        handed_over = False   # set once, by the engine thread's add or by a caller who left before it ran

        def add_on_engine_thread():
            nonlocal handed_over
            with self._adding_lock:
                if handed_over:
                    return
                handed_over = True
                self._num_adding -= 1
                self.engine.add_request(request_id, prompt, sampling_params, priority=priority,
                                        lora_request=lora_request)

        with self._adding_lock:
            self._num_adding += 1
        try:
            try:
                await self._on_engine_thread(add_on_engine_thread)
            finally:
                with self._adding_lock:
                    if not handed_over:
                        handed_over = True
                        self._num_adding -= 1
            self._new_work.set()
            while not done:
                item = await queue.get()
                done = item is _ABORTED or isinstance(item, Exception) or item.finished
                if item is _ABORTED:
                    return
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    raise EngineRequestError(request_id, item.error)
                yield item
        finally:
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if not done and not self._closed:
                # No await here: this also runs while the caller's task is being cancelled.
                self._executor.submit(self.engine.abort_request, request_id)

    async def abort(self, request_id: str) -> None:
        """Drops the request in the engine (freeing its blocks) and ends its stream quietly."""
        if self._closed:
            return
        await self._on_engine_thread(self.engine.abort_request, request_id)
        queue = self._streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(_ABORTED)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """LLMEngine.add_lora on the engine thread, between steps."""
        return await self._on_engine_thread(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """LLMEngine.remove_lora on the engine thread: LoRAInUseError while an unfinished request uses it."""
        return await self._on_engine_thread(self.engine.remove_lora, lora_int_id)

    async def list_loras(self) -> set[int]:
        return await self._on_engine_thread(self.engine.list_loras)

    async def stats(self) -> EngineStats:
        """The engine's figures, read on the engine thread so no step changes them mid-read."""
        return await self._on_engine_thread(self.engine.stats)

    async def call_in_engine_thread(self, fn: Callable, *args):
        """fn(*args) on the engine thread, between steps: how readers of engine state (the dashboard) see it whole."""
        return await self._on_engine_thread(fn, *args)

    async def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead

    def local_engine(self) -> AsyncLLM:
        return self

    def describe(self) -> str:
        kv = self.engine.stats().kv_cache   # read before serving starts, or of figures a step only replaces
        return (f"(dtype {str(self.engine.dtype).removeprefix('torch.')}) with {kv.num_blocks} KV blocks of "
                f"{kv.block_size} tokens ({kv.num_blocks * kv.block_size} tokens)")

    async def shutdown(self) -> None:
        """Stops the step loop and aborts every request; their iterators raise EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        self._dead = self._dead or EngineDeadError("engine shut down")
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait([self._loop_task])
        # Queued behind any step still running on the engine thread.
        await self._on_engine_thread(self._abort_all_in_engine)
        await self._on_engine_thread(self.engine.shutdown)   # tensor-parallel worker processes
        self._executor.shutdown()
        self._fail_streams(list(self._streams), lambda request_id: EngineDeadError("engine shut down"))

    def _start_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop(),
                                                                     name="pagedllm-engine-loop")

    async def _engine_loop(self) -> None:
        try:
            while True:
                # Cleared before the step: a request added while it runs sets it again.
                self._new_work.clear()
                try:
                    outputs, has_unfinished = await self._on_engine_thread(self._step)
                except _StepFailed as failure:
                    logger.error("engine step failed; failing %d in-flight requests",
                                 len(failure.failed_ids), exc_info=failure.__cause__)
                    self._fail_streams(failure.failed_ids, partial(_step_error, failure=failure))
                    continue
                for output in outputs:
                    queue = self._streams.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                if not has_unfinished:
                    await self._new_work.wait()
        except Exception as exc:   # a bug here would otherwise leave every caller waiting forever
            logger.exception("engine loop died")
            self._dead = EngineDeadError("engine loop died")
            self._dead.__cause__ = exc
            self._fail_streams(list(self._streams), lambda request_id: EngineDeadError("engine loop died"))

    def _step(self) -> tuple[list[RequestOutput], bool]:
        """On the engine thread: one step; a failed step aborts everything it held, in the same job,
        so requests added after the failure are not touched."""
        try:
            return self.engine.step(), self.engine.has_unfinished_requests()
        except Exception as exc:
            raise _StepFailed(self._abort_all_in_engine()) from exc

    def _abort_all_in_engine(self) -> list[str]:
        request_ids = list(self.engine.parents)
        self.engine.abort_request(request_ids)
        return request_ids

    def _fail_streams(self, request_ids: list[str], make_error: Callable[[str], Exception]) -> None:
        for request_id in request_ids:
            queue = self._streams.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(make_error(request_id))

    async def _on_engine_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def _step_error(request_id: str, failure: _StepFailed) -> EngineRequestError:
    cause = failure.__cause__
    error = EngineRequestError(request_id, f"engine step failed: {type(cause).__name__}: {cause}")
    error.__cause__ = cause
    return error
