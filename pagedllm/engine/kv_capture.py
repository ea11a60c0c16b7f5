"""The KV cache and the requests as raw data, copied on the engine thread (AsyncLLM.call_in_engine_thread),
between steps: block codes, request rows and block tables, counters, and who holds a block. The dashboard
(entrypoints/openai/kv_map.py) shapes them into frames and JSON; nothing here runs unless it asks."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm.engine.request import Request, RequestStatus
from pagedllm.kv.snapshot import block_codes, block_owners, cached_token_ids


@dataclass
class KVCapture:
    """One moment of the engine: copies, never live references."""
    time: float
    codes: np.ndarray                # per block: ref_count * 2 + cached (kv/snapshot.py)
    rows: dict[str, dict]            # request id -> its row (no table)
    tables: dict[str, list[int]]     # request id -> block ids (requests holding blocks)
    counters: dict = field(default_factory=dict)
    steps: dict | None = None        # the dashboard's step sums since the last capture, if it records them
    owners: dict[int, list[str]] | None = None   # block id -> request ids holding it (with_owners only)
    pin_counts: list[int] | None = None          # per block (with_owners only)


@dataclass
class BlockHolders:
    """One block: who holds it, the tokens it holds, and who took it as a prefix-cache hit."""
    block_id: int
    ref_count: int
    cached: bool
    pin_count: int
    owners: list[str]
    prefix_hit_for: list[str]
    token_ids: list[int]


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
    """What the request is doing: queued, preempted (its KV dropped, or swapped out and kept), prefilling
    (chunk by chunk), decoding."""
    if request.status is RequestStatus.WAITING:
        return "waiting"
    if request.status is RequestStatus.PREEMPTED:
        return "swapped out" if request.num_computed_tokens else "preempted"
    left = request.num_tokens - request.num_computed_tokens
    if left > 1:
        return "prefill"
    return "decoding" if left == 1 else "waiting for siblings"


def request_row(request: Request, group: str | None) -> dict:
    return {"request_id": request.request_id, "status": request.status.value, "phase": phase(request),
            "group": group, "num_prompt_tokens": request.num_prompt_tokens, "num_tokens": request.num_tokens,
            "num_computed_tokens": request.num_computed_tokens, "num_output_tokens": request.num_output_tokens,
            "num_cached_tokens": request.num_cached_tokens}


def capture_kv(engine, with_owners: bool = False) -> KVCapture:
    """Copies the block codes, request rows and tables, and the counters; with_owners also every block's
    holders and pin count (O(pool): for /v1/kv_map, not for every frame). Engine thread only."""
    kv, scheduler = engine.kv_manager, engine.scheduler
    groups = request_groups(engine)
    rows = {request_id: request_row(request, groups.get(request_id))
            for request_id, request in scheduler.requests.items()}
    tables = {request_id: list(kv.get_block_table(request_id)) for request_id in kv.block_tables}
    counters = {"num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
                "num_preemptions": scheduler.num_preemptions, "prefix_cache_queries": kv.prefix_cache_queries,
                "prefix_cache_hits": kv.prefix_cache_hits, "num_pinned_blocks": kv.pool.num_pinned_blocks,
                **tier_figures(kv)}
    captured = KVCapture(time.monotonic(), block_codes(kv), rows, tables, counters)
    if with_owners:
        captured.owners = block_owners(kv)
        captured.pin_counts = [block.pin_count for block in kv.pool.blocks]
    return captured


def tier_figures(kv) -> dict:
    """Blocks below the RAM pool: cached files on disk (with --kv-cache-dir) and swapped-out requests' blocks
    (with preemption by swap, in the tier swap_tier names), as far as the engine has them."""
    figures = {}
    if kv.disk is not None:
        figures |= {"num_disk_blocks": len(kv.disk), "disk_capacity_blocks": kv.disk.capacity_blocks}
    if kv.swap is not None:
        figures |= {"num_swapped_blocks": kv.swap.num_blocks, "swap_tier": kv.swap.tier}
    return figures


def block_holders(engine, block_id: int) -> BlockHolders:
    """One block's holders and tokens (engine thread only); ValueError for an id outside the pool."""
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
    return BlockHolders(block_id, block.ref_count, block.block_hash is not None, block.pin_count, owners,
                        prefix_hit_for, token_ids)
