"""The live KV map: the block map, the requests with their block tables, and step figures, as frames.

`capture(engine)` reads what a frame needs and must run on the engine thread, between steps
(AsyncLLM.call_in_engine_thread); it copies block codes and tables and nothing per token.
`KVMapFeed` turns captures into frames, each a delta against the one before (blocks whose
code changed, tables by what they gained, request rows that changed), so a page on a busy
server with a large pool costs little; `full_frame()` is what a newly connected page starts from.
`StepRecorder` is subscribed to the engine's steps only while a feed runs, so nothing is
recorded per step when no one is looking.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.stats import StepStats
from pagedllm.kv.snapshot import block_codes, block_owners, block_state, cached_token_ids


class StepRecorder:
    """An engine step listener: sums the steps between two frames and keeps their copy-on-write blocks."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.num_steps = 0
        self.scheduling_seconds = self.prepare_seconds = self.model_seconds = 0.0
        self.num_tokens = self.num_preemptions = 0
        self.block_copies: list[tuple[int, int]] = []

    def __call__(self, stats: StepStats) -> None:
        self.num_steps += 1
        self.scheduling_seconds += stats.scheduling_seconds
        self.prepare_seconds += stats.prepare_seconds
        self.model_seconds += stats.model_seconds
        self.num_tokens += stats.num_tokens
        self.num_preemptions += stats.num_preemptions
        if stats.block_copies:
            self.block_copies.extend(stats.block_copies)

    def take(self) -> dict:
        """The sums since the last take, as a frame's `steps` entry."""
        taken = {"num_steps": self.num_steps, "scheduling_seconds": self.scheduling_seconds,
                 "prepare_seconds": self.prepare_seconds, "model_seconds": self.model_seconds,
                 "num_tokens": self.num_tokens, "num_preemptions": self.num_preemptions}
        copies = self.block_copies
        self._reset()
        return {**taken, "block_copies": [list(copy) for copy in copies]}


@dataclass
class Capture:
    """One moment of the engine, copied on the engine thread."""
    time: float
    codes: np.ndarray
    rows: dict[str, dict]            # request id -> its row (no table)
    tables: dict[str, list[int]]     # request id -> block ids (requests holding blocks)
    counters: dict = field(default_factory=dict)
    steps: dict | None = None


def request_groups(engine) -> dict[str, str]:
    """Request id -> the user request it belongs to, for parallel samples and beams (siblings share one)."""
    in_flight = engine.output_processor
    groups = dict(in_flight.parent_of)
    searches = {id(parent.search): parent.request_id for parent in in_flight.beam_searches}
    for request in engine.scheduler.requests.values():
        if request.beam_search is not None:
            groups[request.request_id] = searches.get(id(request.beam_search), request.request_id)
    return groups


def phase(request: Request) -> str:
    """What the request is doing: queued, preempted, prefilling (chunk by chunk), decoding."""
    if request.status is RequestStatus.WAITING:
        return "waiting"
    if request.status is RequestStatus.PREEMPTED:
        return "preempted"
    left = request.num_tokens - request.num_computed_tokens
    if left > 1:
        return "prefill"
    return "decoding" if left == 1 else "waiting for siblings"


def request_row(request: Request, group: str | None) -> dict:
    return {"request_id": request.request_id, "status": request.status.value, "phase": phase(request),
            "group": group, "num_prompt_tokens": request.num_prompt_tokens, "num_tokens": request.num_tokens,
            "num_computed_tokens": request.num_computed_tokens, "num_output_tokens": request.num_output_tokens,
            "num_cached_tokens": request.num_cached_tokens}


def capture(engine, recorder: StepRecorder | None = None) -> Capture:
    """Copies the block codes, request rows and tables, and the counters (engine thread only)."""
    kv, scheduler = engine.kv_manager, engine.scheduler
    groups = request_groups(engine)
    rows = {request_id: request_row(request, groups.get(request_id))
            for request_id, request in scheduler.requests.items()}
    tables = {request_id: list(kv.get_block_table(request_id)) for request_id in kv.block_tables}
    counters = {"num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
                "num_preemptions": scheduler.num_preemptions, "prefix_cache_queries": kv.prefix_cache_queries,
                "prefix_cache_hits": kv.prefix_cache_hits, "num_pinned_blocks": kv.pool.num_pinned_blocks}
    return Capture(time.monotonic(), block_codes(kv), rows, tables, counters,
                   recorder.take() if recorder is not None else None)


def block_figures(codes: np.ndarray) -> dict:
    """Block counts by state, derived from the codes (so they agree with the map by construction)."""
    ref_counts = codes >> 1
    used = int(np.count_nonzero(ref_counts))
    return {"num_blocks": int(codes.size), "num_used_blocks": used,
            "num_shared_blocks": int(np.count_nonzero(ref_counts > 1)),
            "num_cached_idle_blocks": int(np.count_nonzero(codes == 1)),
            "num_free_blocks": int(codes.size) - used, "kv_cache_usage": used / codes.size}


class KVMapFeed:
    """Frames from successive captures; each after the first is a delta against the previous one."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.seq = 0
        self.last: Capture | None = None

    def frame(self, current: Capture) -> dict:
        """The delta from the last capture to this one (a full frame if there was none)."""
        last, self.last = self.last, current
        self.seq += 1
        if last is None:
            return self._frame(current, full=True)
        changed = np.flatnonzero(last.codes != current.codes)
        blocks = np.stack([changed, current.codes[changed]], axis=1).ravel().tolist()
        tables = {}
        for request_id, table in current.tables.items():
            before = last.tables.get(request_id, [])
            if table != before:
                start = len(before) if table[:len(before)] == before else 0
                tables[request_id] = [start, table[start:]]
        removed_tables = [request_id for request_id in last.tables if request_id not in current.tables]
        rows = [row for request_id, row in current.rows.items() if last.rows.get(request_id) != row]
        removed = [request_id for request_id in last.rows if request_id not in current.rows]
        return self._frame(current, full=False, blocks=blocks, tables=tables, removed_tables=removed_tables,
                           rows=rows, removed=removed)

    def full_frame(self) -> dict:
        """The latest capture whole: what a page that just connected starts from."""
        return self._frame(self.last, full=True)

    def _frame(self, current: Capture, full: bool, blocks=None, tables=None, removed_tables=(), rows=None,
               removed=()) -> dict:
        if full:
            blocks = current.codes.tolist()
            tables = {request_id: [0, table] for request_id, table in current.tables.items()}
            rows = list(current.rows.values())
        steps = current.steps if current.steps is not None and not full else None
        return {"seq": self.seq, "time": current.time, "full": full, "block_size": self.block_size,
                "blocks": blocks, "tables": tables, "removed_tables": list(removed_tables),
                "requests": rows, "removed_requests": list(removed),
                "figures": {**block_figures(current.codes), **current.counters}, "steps": steps}


def kv_map_snapshot(engine) -> dict:
    """/v1/kv_map: every block (ref count, cached, state, owners) and every request with its table
    (engine thread only; O(pool), for scripts and tests rather than per frame)."""
    kv = engine.kv_manager
    codes = block_codes(kv).tolist()
    owners = block_owners(kv)
    groups = request_groups(engine)
    requests = []
    for request_id, request in engine.scheduler.requests.items():
        row = request_row(request, groups.get(request_id))
        row["block_table"] = list(kv.get_block_table(request_id)) if request_id in kv.block_tables else []
        requests.append(row)
    blocks = [{"block_id": block_id, "ref_count": code >> 1, "cached": bool(code & 1), "state": block_state(code),
               "pin_count": kv.pool.blocks[block_id].pin_count, "owners": owners.get(block_id, [])}
              for block_id, code in enumerate(codes)]
    return {"num_blocks": kv.pool.num_blocks, "block_size": kv.block_size,
            "figures": {**block_figures(np.asarray(codes, dtype=np.int32)),
                        "prefix_cache_queries": kv.prefix_cache_queries, "prefix_cache_hits": kv.prefix_cache_hits,
                        "num_pinned_blocks": kv.pool.num_pinned_blocks},
            "blocks": blocks, "requests": requests}


def block_detail(engine, block_id: int) -> dict:
    """One block for the page's hover: owners, the tokens it holds (ids and decoded text), whether an owner
    took it as a prefix-cache hit (engine thread only)."""
    kv = engine.kv_manager
    if not 0 <= block_id < kv.pool.num_blocks:
        raise ValueError(f"block_id must be in [0, {kv.pool.num_blocks}), got {block_id}")
    block = kv.pool.blocks[block_id]
    size = kv.block_size
    owners, token_ids, prefix_hit_for = [], None, []
    for request_id in kv.block_tables:
        table = kv.get_block_table(request_id)
        if block_id not in table:
            continue
        owners.append(request_id)
        index = table.index(block_id)
        request = engine.scheduler.requests.get(request_id)
        if request is None:
            continue
        if token_ids is None:
            start = index * size
            token_ids = request.all_token_ids[start:min(start + size, request.num_computed_tokens)]
        if index < request.num_cached_tokens // size:
            prefix_hit_for.append(request_id)
    if token_ids is None:
        token_ids = cached_token_ids(kv, block_id)
    code = block.ref_count * 2 + (block.block_hash is not None)
    return {"block_id": block_id, "ref_count": block.ref_count, "cached": block.block_hash is not None,
            "state": block_state(code), "pin_count": block.pin_count, "owners": owners,
            "prefix_hit_for": prefix_hit_for,
            "token_ids": token_ids,
            "text": engine.tokenizer.decode(token_ids, skip_special_tokens=False) if token_ids else ""}
