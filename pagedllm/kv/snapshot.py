"""The KV cache's block map as plain numbers, for the dashboard, /v1/kv_map and the benchmark traces.

Each physical block gets one code, `ref_count * 2 + cached` (cached: it holds a full block's
KV under a prefix-cache hash), so a whole pool reads as one int32 array and two moments
compare in one vectorised step: a map update sends only the blocks whose code changed.
Reading the pool is O(blocks) in C-level loops (about 2 ms for 100k blocks on this CPU);
nothing here runs unless someone asks for a map.
"""
from __future__ import annotations

from operator import attrgetter

import numpy as np

from pagedllm.kv.manager import KVCacheManager

FREE, CACHED_IDLE, IN_USE, SHARED = "free", "cached_idle", "in_use", "shared"

_ref_count = attrgetter("ref_count")
_block_id = attrgetter("block_id")


def block_codes(manager: KVCacheManager) -> np.ndarray:
    """`ref_count * 2 + cached` for every block, indexed by block id."""
    pool = manager.pool
    codes = np.fromiter(map(_ref_count, pool.blocks), dtype=np.int32, count=pool.num_blocks) * 2
    cached = pool.cached_blocks
    codes[np.fromiter(map(_block_id, cached.values()), dtype=np.int64, count=len(cached))] += 1
    return codes


def block_state(code: int) -> str:
    """The dashboard's colour class of a block code."""
    ref_count = code >> 1
    if ref_count == 0:
        return CACHED_IDLE if code & 1 else FREE
    return IN_USE if ref_count == 1 else SHARED


def changed_blocks(previous: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Ids of the blocks whose code differs between two maps of the same pool."""
    return np.flatnonzero(previous != current)


def block_owners(manager: KVCacheManager) -> dict[int, list[str]]:
    """Block id -> the requests whose tables hold it, in table order (O(table entries), not O(pool))."""
    owners: dict[int, list[str]] = {}
    for request_id in manager.block_tables:
        for block_id in manager.get_block_table(request_id)[manager.num_released_blocks(request_id):]:
            owners.setdefault(block_id, []).append(request_id)
    return owners


def cached_token_ids(manager: KVCacheManager, block_id: int) -> list[int]:
    """The tokens a block was cached under ([] if it is not in the prefix cache)."""
    block = manager.pool.blocks[block_id]
    return list(block.block_key[1]) if block.block_key is not None else []
