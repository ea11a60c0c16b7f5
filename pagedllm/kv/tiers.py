"""The tiers below the pool as the scheduler and the workers see them: which requests wait for blocks coming back
(disk loads, swap-ins), the step's tier work handed to the workers, and the block-hash log a data-parallel router
reads.

The books themselves are kv/disk_loads.py's and kv/swapped_requests.py's; the manager (kv/manager.py) decides what
to load, swap out and install again, since that needs its tables.
"""
from __future__ import annotations

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.disk_loads import DiskLoads, DiskWork
from pagedllm.kv.disk_tier import DiskTier
from pagedllm.kv.hash_log import DISK, RAM, BlockHashLog, short_hash
from pagedllm.kv.swap import SwapSpace
from pagedllm.kv.swapped_requests import SwappedRequests


class KVTiers:
    def __init__(self, pool: BlockPool, block_size: int, disk: DiskTier | None, swap: SwapSpace | None):
        self.pool = pool
        self.disk = disk
        self.swap = swap
        self.disk_loads = DiskLoads(pool, disk) if disk is not None else None
        self.swapped = SwappedRequests(pool, swap, block_size) if swap is not None else None

    @property
    def books(self) -> list[DiskLoads | SwappedRequests]:
        """The disk loads' and the swapped requests' books, where the tiers keep their per-request state."""
        return [books for books in (self.disk_loads, self.swapped) if books is not None]

    def is_loading(self, request_id: str) -> bool:
        """Whether the request waits for blocks being read back (disk hits or a swap-in) in the current step."""
        return ((self.disk_loads is not None and request_id in self.disk_loads)
                or (self.swapped is not None and self.swapped.is_swapping_in(request_id)))

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request's KV waits in the swap space (swapped out, not yet swapped in)."""
        return self.swapped is not None and self.swapped.is_swapped(request_id)

    def swap_in(self, request_id: str, num_tokens: int) -> bool:
        """Starts bringing a swapped-out request of num_tokens tokens back: its copies are read back in this
        step (the request waits: is_loading). Only when every block the request needs is free now (as
        load_from_disk); False, with nothing changed, otherwise."""
        return self.swapped is not None and self.swapped.swap_in(request_id, num_tokens)

    def restored_tokens(self, request_id: str) -> int | None:
        """The computed tokens of a request swapped back in and not yet admitted (its table is in place)."""
        return self.swapped.restored_tokens(request_id) if self.swapped is not None else None

    def take_restored(self, request_id: str) -> None:
        """The swapped-in request is admitted: from now on it is an ordinary running request."""
        if self.swapped is not None:
            self.swapped.take_restored(request_id)

    def take_work(self) -> DiskWork | None:
        """The step's tier work, once every allocation of the step is made (None without a disk tier or a
        swap space)."""
        if self.disk is None and self.swap is None:
            return None
        work = DiskWork([], [], [])
        if self.disk_loads is not None:
            work = DiskWork(self.disk_loads.take_spills(), self.disk_loads.take_loads(), self.disk.take_deletes(),
                            read_ahead=self.disk_loads.take_read_ahead())
        if self.swapped is not None:
            work.swap_outs, work.swap_ins, work.swap_drops = self.swapped.take_work()
        return work

    def publish_block_hashes(self, max_events: int) -> BlockHashLog:
        """From now on the pool and the disk tier record the hashes they gain and lose in the returned log (a
        data-parallel replica reports them to its router); its first report is a snapshot (block_hash_snapshot)."""
        log = BlockHashLog(max_events)
        self.pool.hash_log = log
        if self.disk is not None:
            self.disk.hash_log = log
        return log

    def block_hash_snapshot(self) -> dict[int, int]:
        """Short hash -> tier bits of every block the prefix cache and the disk tier hold now; restarts the log,
        whose events from here on follow this snapshot. On the engine thread."""
        held = {short_hash(block_hash): RAM for block_hash in self.pool.cached_blocks}
        for block_hash in self.disk.entries if self.disk is not None else ():
            key = short_hash(block_hash)
            held[key] = held.get(key, 0) | DISK
        self.pool.hash_log.restart()
        return held
