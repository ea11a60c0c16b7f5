"""The live KV-cache view: `GET /dashboard` (one self-contained page), `/v1/kv_map` (a JSON snapshot),
`/v1/kv_map/blocks/{id}` (one block, for the page's hover) and `/v1/kv_map/events` (the page's feed).

The page's shell holds no engine data and a browser cannot attach a bearer key to a navigation, so
/dashboard is served without the key; it asks for the key and sends it with every data request, which
sits behind --api-key like every route but /health. The feed is Server-Sent Events read with fetch
(EventSource cannot send headers): one producer task runs only while a page is connected, captures
the engine between steps at most 5 times a second, and stretches that interval so the captures take
at most 1% of the engine thread however large the pool; every page gets the same delta frames.
Frames are built and JSON-encoded once per interval on the feed's own thread (started with the
producer, gone with it), never on the event loop that serves the requests; so is a full frame, once per
capture, for pages that connect or fall behind.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from importlib import resources

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from pagedllm.engine.protocol import LocalEngine
from pagedllm.entrypoints.openai.kv_map import KVMapFeed, StepRecorder, block_detail, capture, kv_map_snapshot
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.response_protocol import ERROR_RESPONSES

logger = logging.getLogger(__name__)

MIN_FRAME_INTERVAL = 0.2      # seconds: at most 5 frames a second
MAX_ENGINE_SHARE = 0.01       # captures may take this fraction of the engine thread, at most
SUBSCRIBER_BACKLOG = 16       # frames a slow page may lag before it is sent a full frame instead
_RESYNC = object()            # queued for a page that fell behind: it is sent the latest full frame next

router = APIRouter()


class _FeedStopped(Exception):
    """The feed's thread is gone: a page's stream ends."""


class DashboardHub:
    """The pages' shared feed: starts with the first subscriber, stops with the last."""

    def __init__(self, llm: LocalEngine, api_key_required: bool):
        self.llm = llm
        self.api_key_required = api_key_required
        self.feed = KVMapFeed(llm.engine.kv_manager.block_size)
        self._subscribers: set[asyncio.Queue] = set()
        self._first_frame = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._encoder: ThreadPoolExecutor | None = None   # the feed's thread, while the producer runs
        self._full_event: tuple[int, str] | None = None   # (seq, event): the latest full frame, encoded once

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    async def subscribe(self) -> AsyncIterator[str]:
        """Yields the page's Server-Sent Events: a full frame, then deltas, until the page goes or the engine stops."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_BACKLOG)
        self._subscribers.add(queue)
        if self._task is None or self._task.done():
            self._first_frame.clear()
            self.feed = KVMapFeed(self.feed.block_size)
            self._task = asyncio.get_running_loop().create_task(self._produce(), name="pagedllm-dashboard")
        try:
            await self._first_frame.wait()
            if self.feed.last is None:   # the producer stopped before its first capture
                return
            seq, event = await self._encoded_full_frame()
            yield event
            while (item := await queue.get()) is not None:
                if item is _RESYNC:
                    seq, event = await self._encoded_full_frame()
                    yield event
                elif item[0] > seq:   # frames up to the full one's are in it already
                    seq, event = item
                    yield event
        except _FeedStopped:
            return
        finally:
            self._subscribers.discard(queue)

    async def _produce(self) -> None:
        engine, recorder = self.llm.engine, StepRecorder()
        self._encoder = encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-dashboard")
        self._full_event = None
        loop = asyncio.get_running_loop()
        try:
            await self.llm.call_in_engine_thread(engine.step_listeners.append, recorder)
            while self._subscribers:
                started = time.monotonic()
                current, seconds = await self.llm.call_in_engine_thread(_timed_capture, engine, recorder)
                frame = await loop.run_in_executor(encoder, _encoded_frame, self.feed, current)
                self._first_frame.set()
                for queue in list(self._subscribers):
                    _offer(queue, frame)
                interval = max(MIN_FRAME_INTERVAL, seconds / MAX_ENGINE_SHARE)
                await asyncio.sleep(max(0.0, started + interval - time.monotonic()))
        except RuntimeError as exc:   # the engine shut down: its thread takes no more work
            logger.info("dashboard feed stopped: %s", exc)
        except Exception:
            logger.exception("dashboard feed failed")
        finally:
            self._first_frame.set()
            with contextlib.suppress(Exception):
                await self.llm.call_in_engine_thread(_remove_listener, engine, recorder)
            for queue in list(self._subscribers):
                _offer(queue, None)
            encoder.shutdown(wait=False)

    async def _encoded_full_frame(self) -> tuple[int, str]:
        """(seq, event) of the latest capture as a full frame, encoded on the feed's thread once per capture
        however many pages ask (one thread: the feed is never read while it takes the next frame)."""
        def encode() -> tuple[int, str]:
            if self._full_event is None or self._full_event[0] != self.feed.seq:
                self._full_event = (self.feed.seq, _event(self.feed.full_frame()))
            return self._full_event

        try:
            return await asyncio.get_running_loop().run_in_executor(self._encoder, encode)
        except RuntimeError as exc:   # the producer stopped and its thread with it
            raise _FeedStopped from exc


def _encoded_frame(feed: KVMapFeed, current) -> tuple[int, str]:
    """(seq, event) of the next frame (the feed's thread)."""
    frame = feed.frame(current)
    return frame["seq"], _event(frame)


def _timed_capture(engine, recorder: StepRecorder):
    started = time.perf_counter()
    return capture(engine, recorder), time.perf_counter() - started


def _remove_listener(engine, recorder: StepRecorder) -> None:
    if recorder in engine.step_listeners:
        engine.step_listeners.remove(recorder)


def _offer(queue: asyncio.Queue, frame: tuple[int, str] | None) -> None:
    """Queues a frame's (seq, event), or None for the end; a page too far behind loses its backlog and gets
    the latest full frame instead."""
    try:
        queue.put_nowait(frame)
    except asyncio.QueueFull:
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(_RESYNC if frame is not None else None)


def _event(frame: dict) -> str:
    return f"id: {frame['seq']}\nevent: frame\ndata: {json.dumps(frame, separators=(',', ':'))}\n\n"


def _hub(request: Request) -> DashboardHub:
    return request.app.state.dashboard


@cache
def dashboard_page() -> tuple[str, str]:
    """The page with its CSS and JS inlined, and a Content-Security-Policy that allows exactly those."""
    static = resources.files("pagedllm.entrypoints.openai") / "static"
    style, script = (static / "dashboard.css").read_text(), (static / "dashboard.js").read_text()

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    html = (static / "dashboard.html").read_text().replace("/*STYLE*/", style).replace("/*SCRIPT*/", script)
    policy = (f"default-src 'none'; style-src {digest(style)}; script-src {digest(script)}; connect-src 'self'; "
              "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
    return html, policy


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard(request: Request) -> HTMLResponse:
    html, policy = dashboard_page()
    html = html.replace("/*KEY_REQUIRED*/", "true" if _hub(request).api_key_required else "false")
    return HTMLResponse(html, headers={"Content-Security-Policy": policy, "Cache-Control": "no-store"})


@router.get("/v1/kv_map", responses=ERROR_RESPONSES)
async def kv_map(request: Request) -> dict:
    """Every KV block (ref count, cached, state, owners) and every request with its block table."""
    llm = _hub(request).llm
    return await llm.call_in_engine_thread(kv_map_snapshot, llm.engine)


@router.get("/v1/kv_map/blocks/{block_id}", responses=ERROR_RESPONSES)
async def kv_block(block_id: int, request: Request) -> dict:
    """One block: its owners, the tokens it holds (decoded), whether it was a prefix-cache hit."""
    llm = _hub(request).llm
    try:
        return await llm.call_in_engine_thread(partial(block_detail, llm.engine, block_id))
    except ValueError as exc:
        raise APIError(400, str(exc), param="block_id") from exc


@router.get("/v1/kv_map/events", response_class=StreamingResponse, responses=ERROR_RESPONSES)
async def kv_map_events(request: Request) -> StreamingResponse:
    """Server-Sent Events, `event: frame`: a full frame, then deltas at most 5 a second."""
    return StreamingResponse(_hub(request).subscribe(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def install_dashboard(app: FastAPI, llm: LocalEngine, api_key_required: bool) -> None:
    app.state.dashboard = DashboardHub(llm, api_key_required)
    app.include_router(router)
