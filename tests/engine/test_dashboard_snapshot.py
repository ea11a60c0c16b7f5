"""The KV map's data against the KV manager's own state: every block's ref count, cached flag and owners,
the delta frames (replayed, they rebuild each step's map and tables), the recorded copy-on-write blocks,
a block's tokens and prefix-cache hits, and the routes' switches (--api-key, --disable-dashboard)."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections import Counter

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core import EngineCore
from pagedllm.engine.kv_capture import capture_kv, request_row
from pagedllm.entrypoints.openai.kv_map import KVMapFeed, StepRecorder, block_detail, capture, kv_map_snapshot
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.api_server import build_app
from pagedllm.entrypoints.openai import dashboard
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.snapshot import block_codes, block_owners
from pagedllm.sampling_params import SamplingParams

# Longer than two blocks of 16, so n = 4 siblings keep two full blocks shared and copy the third on write.
PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
          "and lit the lamp that guided the fishing boats home through the fog.")


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory="16MiB", max_model_len=256, seed=0))


def manager_view(kv: KVCacheManager) -> list[tuple[int, bool, list[str]]]:
    """(ref count, cached, owners) per block, from the manager's KVBlock objects (not its id lists)."""
    owners: dict[int, list[str]] = {}
    for request_id, table in kv.block_tables.items():
        for block in table:
            owners.setdefault(block.block_id, []).append(request_id)
    return [(block.ref_count, block.block_hash is not None, sorted(owners.get(block.block_id, [])))
            for block in kv.pool.blocks]


def replay(frames: list[dict]) -> tuple[list[int], dict[str, list[int]], dict[str, dict]]:
    """What a page holds after applying the frames, as dashboard.js does."""
    codes, tables, rows = [], {}, {}
    for frame in frames:
        if frame["full"]:
            codes, tables, rows = list(frame["blocks"]), {}, {}
        else:
            for index in range(0, len(frame["blocks"]), 2):
                codes[frame["blocks"][index]] = frame["blocks"][index + 1]
        for request_id, (start, ids) in frame["tables"].items():
            tables[request_id] = tables.get(request_id, [])[:start] + ids
        for request_id in frame["removed_tables"]:
            del tables[request_id]
        rows.update((row["request_id"], row) for row in frame["requests"])
        for request_id in frame["removed_requests"]:
            rows.pop(request_id, None)
            tables.pop(request_id, None)
    return codes, tables, rows


def test_snapshot_and_deltas_match_the_kv_manager_step_by_step(engine):
    kv = engine.kv_manager
    recorder = StepRecorder()
    engine.step_listeners.append(recorder)
    feed = KVMapFeed(kv.block_size)
    frames = [feed.frame(capture(engine, recorder))]
    copies_seen, max_ref_count = [], 0
    try:
        engine.add_request("fan", PROMPT, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=24,
                                                         ignore_eos=True))
        engine.add_request("plain", PROMPT[:40], SamplingParams(max_tokens=12, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            copies_seen += engine.last_step_stats.block_copies
            frames.append(feed.frame(capture(engine, recorder)))
            snapshot = kv_map_snapshot(engine)
            view = manager_view(kv)
            assert [(b["ref_count"], b["cached"], sorted(b["owners"])) for b in snapshot["blocks"]] == view
            max_ref_count = max(max_ref_count, max(ref for ref, _, _ in view))
            codes, tables, rows = replay(frames)
            assert codes == [ref * 2 + cached for ref, cached, _ in view]
            assert tables == {request_id: [block.block_id for block in table]
                              for request_id, table in kv.block_tables.items()}
            assert set(rows) == set(engine.scheduler.requests)
            assert snapshot["figures"]["num_used_blocks"] == kv.usage().num_used_blocks
    finally:
        engine.step_listeners.remove(recorder)
    assert max_ref_count == 4                      # the prompt's full blocks, held by all four samples
    assert copies_seen, "the siblings' shared partial block was never copied on write"
    recorded = [tuple(copy) for frame in frames[1:] for copy in frame["steps"]["block_copies"]]
    assert recorded == copies_seen
    assert sum(frame["steps"]["num_steps"] for frame in frames[1:]) == len(frames) - 1
    assert all(ref == 0 for ref, _, _ in manager_view(kv))


def test_a_repeated_prompt_shows_prefix_hits_and_its_tokens(engine):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("first", PROMPT, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("again", PROMPT, params)
    engine.step()
    request = engine.scheduler.requests["again"]
    table = kv_map_snapshot(engine)["requests"][0]["block_table"]
    assert request.num_cached_tokens == (len(request.prompt_token_ids) - 1) // 16 * 16 > 0
    first = block_detail(engine, table[0])
    assert first["owners"] == ["again"] and first["prefix_hit_for"] == ["again"]
    assert first["token_ids"] == request.all_token_ids[:16]
    assert first["text"] == engine.tokenizer.decode(request.all_token_ids[:16], skip_special_tokens=False)
    last = block_detail(engine, table[-1])
    assert last["prefix_hit_for"] == []            # computed by this request, not found in the cache
    while engine.has_unfinished_requests():
        engine.step()
    idle = block_detail(engine, table[0])          # cached and idle: its tokens come from the cache key
    assert idle["state"] == "cached_idle" and idle["owners"] == [] and idle["token_ids"] == request.all_token_ids[:16]
    with pytest.raises(ValueError, match=r"block_id must be in \[0, \d+\), got -1"):
        block_detail(engine, -1)


def test_block_codes_of_a_pool_with_every_state():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    kv.allocate_slots("a", 12, 0)
    kv.cache_full_blocks("a", tokens, 12)
    kv.fork("a", "b")
    kv.allocate_slots("c", 3, 0)
    kv.free("c")
    codes = block_codes(kv)
    assert codes.dtype == np.int32
    assert codes.tolist() == [5, 5, 5, 0, 0, 0, 0, 0]   # ref 2 + cached; block 3 was c's, freed uncached
    kv.free("a")
    kv.free("b")
    assert block_codes(kv).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


def test_routes_need_the_key_and_can_be_switched_off(engine):
    with TestClient(build_app(AsyncLLM(engine), ServerConfig(api_key="secret"))) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and 'data-api-key-required="true"' in page.text
        assert "script-src 'sha256-" in page.headers["content-security-policy"]
        assert client.get("/v1/kv_map").status_code == 401
        assert client.get("/v1/kv_map/events").status_code == 401
        answer = client.get("/v1/kv_map", headers={"Authorization": "Bearer secret"}).json()
        assert answer["num_blocks"] == len(answer["blocks"]) == engine.kv_manager.pool.num_blocks
        refused = client.get("/v1/kv_map/blocks/100000", headers={"Authorization": "Bearer secret"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "block_id"
    with TestClient(build_app(AsyncLLM(engine), ServerConfig(disable_dashboard=True))) as client:
        assert client.get("/dashboard").status_code == 404
        assert client.get("/v1/kv_map").status_code == 404


def test_no_snapshot_work_while_no_page_is_open(engine):
    """Counted by a profile hook on every thread (the engine's, the server's), not by the code under test:
    requests served with no page open run no capture, no block code, no frame and no step recorder; the
    hook does see the engine thread's steps, and the snapshot route's capture once asked."""
    watched = {function.__code__: name for name, function in {
        "step": EngineCore.step, "capture_kv": capture_kv, "request_row": request_row, "block_codes": block_codes,
        "block_owners": block_owners, "frame": KVMapFeed.frame, "full_frame": KVMapFeed.full_frame,
        "encode": dashboard._event, "record": StepRecorder.__call__}.items()}
    calls = Counter()

    def count(frame, event, arg):
        if event == "call" and frame.f_code in watched:
            calls[watched[frame.f_code]] += 1

    threading.setprofile(count)
    sys.setprofile(count)
    try:
        with TestClient(build_app(AsyncLLM(engine), ServerConfig())) as client:
            for _ in range(2):
                answer = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "n": 2})
                assert answer.status_code == 200
            assert calls["step"] >= 8 and engine.step_listeners == []
            assert set(calls) == {"step"}, calls
            assert client.get("/v1/kv_map").status_code == 200
            assert calls["capture_kv"] == calls["block_codes"] == calls["block_owners"] == 1
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def test_frames_are_built_and_encoded_off_the_event_loop_once_for_every_page(engine):
    """Two pages read the feed: every frame and full frame is built and JSON-encoded on the feed's thread
    (a profile hook names the thread of each call), the two pages get the same events, decoded they are
    the feed's frames in order, and once both pages go the feed's thread and the step listener are gone."""
    built = {dashboard._event.__code__: "encode", KVMapFeed.frame.__code__: "frame",
             KVMapFeed.full_frame.__code__: "full_frame"}
    threads = Counter()

    def record(frame, event, arg):
        if event == "call" and frame.f_code in built:
            threads[(built[frame.f_code], threading.current_thread().name.split("_")[0])] += 1

    async def read_two_pages() -> tuple[list[str], list[str], str]:
        hub = dashboard.DashboardHub(AsyncLLM(engine), api_key_required=False)
        pages = [hub.subscribe(), hub.subscribe()]
        first = [await page.__anext__() for page in pages]
        following = [[await page.__anext__() for _ in range(3)] for page in pages]
        for page in pages:
            await page.aclose()
        await hub._task
        return [first[0], *following[0]], [first[1], *following[1]], threading.current_thread().name

    threading.setprofile(record)
    sys.setprofile(record)
    try:
        one, other, loop_thread = asyncio.run(read_two_pages())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert one == other
    frames = [json.loads(event.split("data: ", 1)[1]) for event in one]
    assert frames[0]["full"] and not any(frame["full"] for frame in frames[1:])
    assert [frame["seq"] for frame in frames[1:]] == [frames[0]["seq"] + 1, frames[0]["seq"] + 2,
                                                      frames[0]["seq"] + 3]
    assert {thread for _, thread in threads} == {"pagedllm-dashboard"}, (threads, loop_thread)
    assert threads[("full_frame", "pagedllm-dashboard")] == 1   # encoded once, sent to both pages
    assert threads[("frame", "pagedllm-dashboard")] >= 4
    feed_threads = [thread for thread in threading.enumerate() if thread.name.startswith("pagedllm-dashboard")]
    for thread in feed_threads:   # shut down without waiting: it ends once it sees the shutdown
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in feed_threads)
    assert engine.step_listeners == []
