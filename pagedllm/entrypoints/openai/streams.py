"""Plumbing between engine output streams and HTTP: merging, client disconnects, Server-Sent Events.

Every engine stream here is iterated inside a task of its own, so cancelling that task is
what aborts its request (AsyncLLM.generate aborts when its iterator is cancelled) and no
await is needed to clean up, even from code that is itself being cancelled.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import APIError, api_error_for, error_body

logger = logging.getLogger(__name__)
T = TypeVar("T")
_END = object()

SSE_DONE = "data: [DONE]\n\n"


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yields (stream index, item) as items arrive from any stream; re-raises the first error.

    Closing the merged iterator early (or an error) cancels the streams still running.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as exc:   # handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away.

    The body has been read by then, so the server's next receive() message can only be
    http.disconnect: waiting on it is `await request.is_disconnected()` without polling.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Runs work to its end, or cancels it (aborting its requests) and returns None if the client leaves."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
    return work_task.result() if work_task.done() and not work_task.cancelled() else None


def sse_event(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def sse_typed_event(payload: dict) -> str:
    """An event named by its type, as the Responses and Messages APIs send them: `event:` then `data:`."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def mid_stream_error(exc: Exception, request_id: str) -> APIError:
    """A failure after the stream has begun (the 200 is sent, so it travels as an event), logged if the server's."""
    error = api_error_for(exc)
    if error.status >= 500:
        logger.error("request %s failed mid-stream", request_id, exc_info=exc)
    return error


def sse_error(exc: Exception, request_id: str) -> str:
    error = mid_stream_error(exc, request_id)
    return sse_event(error_body(error.status, error.message, error.param, error.code))


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """Starlette cancels `events` when the client disconnects, which aborts the requests behind it."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
