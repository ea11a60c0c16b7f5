"""The live KV map as the dashboard shows it: the engine's raw captures (engine/kv_capture.py) shaped into
frames, /v1/kv_map's JSON and one block's detail.

`KVMapFeed` turns captures into frames, each a delta against the one before (blocks whose code changed,
tables by what they gained, request rows that changed), so a page on a busy server with a large pool costs
little; `full_frame()` is what a newly connected page starts from. `StepRecorder` is subscribed to the
engine's steps only while a feed runs, so nothing is recorded per step when no one is looking.
"""
from __future__ import annotations

import numpy as np

from pagedllm.engine.kv_capture import KVCapture, block_holders, capture_kv
from pagedllm.engine.stats import StepStats
from pagedllm.kv.snapshot import block_state


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


def capture(engine, recorder: StepRecorder | None = None) -> KVCapture:
    """A frame's capture, with the steps the recorder summed since the last one (engine thread only)."""
    captured = capture_kv(engine)
    captured.steps = recorder.take() if recorder is not None else None
    return captured


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
        self.last: KVCapture | None = None

    def frame(self, current: KVCapture) -> dict:
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

    def _frame(self, current: KVCapture, full: bool, blocks=None, tables=None, removed_tables=(), rows=None,
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
    captured = capture_kv(engine, with_owners=True)
    codes = captured.codes.tolist()
    requests = [{**row, "block_table": captured.tables.get(request_id, [])}
                for request_id, row in captured.rows.items()]
    blocks = [{"block_id": block_id, "ref_count": code >> 1, "cached": bool(code & 1), "state": block_state(code),
               "pin_count": captured.pin_counts[block_id], "owners": captured.owners.get(block_id, [])}
              for block_id, code in enumerate(codes)]
    counters = captured.counters
    return {"num_blocks": len(codes), "block_size": engine.kv_manager.block_size,
            "figures": {**block_figures(captured.codes), "prefix_cache_queries": counters["prefix_cache_queries"],
                        "prefix_cache_hits": counters["prefix_cache_hits"],
                        "num_pinned_blocks": counters["num_pinned_blocks"]},
            "blocks": blocks, "requests": requests}


def block_detail(engine, block_id: int) -> dict:
    """One block for the page's hover: owners, the tokens it holds (ids and decoded text), whether an owner
    took it as a prefix-cache hit (engine thread only)."""
    block = block_holders(engine, block_id)
    code = block.ref_count * 2 + block.cached
    return {"block_id": block.block_id, "ref_count": block.ref_count, "cached": block.cached,
            "state": block_state(code), "pin_count": block.pin_count, "owners": block.owners,
            "prefix_hit_for": block.prefix_hit_for, "token_ids": block.token_ids,
            "text": engine.tokenizer.decode(block.token_ids, skip_special_tokens=False) if block.token_ids else ""}
