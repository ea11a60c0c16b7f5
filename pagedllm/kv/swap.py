"""Room for preempted requests' blocks (preemption by swap): a RAM staging area of its own capacity, or a
share of the disk tier's quota that its LRU eviction never touches.

Bookkeeping only, in blocks: the manager reserves room before it swaps a request out and gives it back when
the request is swapped in or ends; the worker's swap space (pagedllm/worker/kv_swap.py) holds the bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.disk_tier import DiskTier

SwapKey = int   # names one swapped block in the worker's swap space, unique within the engine's life


@dataclass
class SwapCounters:
    """Since start-up."""
    swap_outs: int = 0       # requests swapped out
    swap_ins: int = 0        # requests swapped back in
    blocks_out: int = 0      # blocks copied out
    blocks_in: int = 0       # blocks copied back
    blocks_reused: int = 0   # copied out, then found still in the prefix cache on swap-in (not copied back)
    refused: int = 0         # swap-outs refused for want of room (those requests recompute)
    failed_blocks: int = 0   # blocks that could not be read back (their tokens are recomputed)


class SwapSpace:
    def __init__(self, capacity_blocks: int, disk: DiskTier | None = None):
        """disk: swap into the disk tier, within its quota (capacity_blocks is then the tier's); else RAM."""
        if capacity_blocks < 0:
            raise ValueError(f"the swap space's capacity must be >= 0 blocks, got {capacity_blocks}")
        self.disk = disk
        self.capacity_blocks = disk.capacity_blocks if disk is not None else capacity_blocks
        self.num_blocks = 0   # reserved by swapped-out requests now
        self.counters = SwapCounters()
        self._next_key = 0

    @property
    def tier(self) -> str:
        return "disk" if self.disk is not None else "ram"

    def reserve(self, num_blocks: int) -> bool:
        """Room for num_blocks more swapped blocks (on disk, cached files make room, least recently used
        first); False, and nothing reserved, when they do not fit."""
        if self.num_blocks + num_blocks > self.capacity_blocks:
            self.counters.refused += 1
            return False
        self.num_blocks += num_blocks
        if self.disk is not None:
            self.disk.reserve(num_blocks)
        return True

    def release(self, num_blocks: int) -> None:
        self.num_blocks -= num_blocks
        if self.disk is not None:
            self.disk.release(num_blocks)

    def new_keys(self, count: int) -> list[SwapKey]:
        keys = list(range(self._next_key, self._next_key + count))
        self._next_key += count
        return keys
