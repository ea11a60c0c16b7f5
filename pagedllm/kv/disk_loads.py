"""Disk hits on their way back into the pool, and the step's tier work handed to the workers.

A waiting request whose prefix continues on disk gets free blocks for those disk blocks; their reads are queued
for the next step (loading), and its RAM hits and the blocks once loaded are held for it (staged) until it is
admitted, so nothing of its prefix is evicted meanwhile; while its blocks are not free yet, its disk blocks are
named once for the workers to read ahead. The manager decides which request loads (kv/manager.py); this module
keeps those blocks, completes the loads and turns the pool's evictions into spills.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.kv.block_pool import BlockHash, BlockKey, BlockPool, KVBlock
from pagedllm.kv.disk_tier import DiskTier, KeyDigest, key_digest
from pagedllm.kv.swap import SwapKey


@dataclass
class DiskWork:
    """What the workers do with the KV tiers in one step, in this order: copy the spilled and swapped-out
    blocks out (the step may overwrite them), read the loads and swap-ins in, then hand writes and deletes to
    the background writer and drop the swapped blocks no one will read."""
    spills: list[tuple[int, BlockHash, KeyDigest]]   # (block id, hash, key digest)
    loads: list[tuple[int, BlockHash, KeyDigest]]
    deletes: list[BlockHash]
    swap_outs: list[tuple[int, SwapKey]] = field(default_factory=list)   # (block id, key)
    swap_ins: list[tuple[int, SwapKey]] = field(default_factory=list)
    swap_drops: list[SwapKey] = field(default_factory=list)
    # Blocks of waiting requests to read into memory ahead of their loads (a hint: nothing waits on it).
    read_ahead: list[tuple[BlockHash, KeyDigest]] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.spills or self.loads or self.deletes or self.swap_outs or self.swap_ins or self.swap_drops)


class DiskLoads:
    def __init__(self, pool: BlockPool, disk: DiskTier):
        self.pool = pool
        self.disk = disk
        self._loading: dict[str, list[tuple[KVBlock, BlockHash, BlockKey]]] = {}   # read in the coming step
        self._staged: dict[str, list[KVBlock]] = {}   # held for the request until it is admitted
        self._pending: list[tuple[int, BlockHash, KeyDigest]] = []
        self._read_ahead: list[tuple[BlockHash, KeyDigest]] = []
        self._read_ahead_for: set[str] = set()   # requests whose blocks were named for read-ahead

    def __contains__(self, request_id: str) -> bool:
        """Whether the request's disk blocks are read in the current step."""
        return request_id in self._loading

    def start(self, request_id: str, ram_hits: list[KVBlock], found: list[tuple[BlockHash, BlockKey]]) -> None:
        """Holds the RAM hits (the caller has taken a reference on them) and takes free blocks for the disk
        blocks `found`, whose reads are queued for the next step."""
        self.release(request_id)
        blocks = self.pool.allocate(len(found))
        self._staged[request_id] = list(ram_hits)
        self._loading[request_id] = [(block, block_hash, key) for block, (block_hash, key) in zip(blocks, found)]
        self._pending.extend((block.block_id, block_hash, key_digest(key))
                             for block, (block_hash, key) in zip(blocks, found))

    def read_ahead(self, request_id: str, found: list[tuple[BlockHash, BlockKey]]) -> None:
        """The request's disk blocks, which it cannot load yet (too few free blocks), are read into the workers'
        memory meanwhile; named once per request."""
        if request_id not in self._read_ahead_for:
            self._read_ahead_for.add(request_id)
            self._read_ahead.extend((block_hash, key_digest(key)) for block_hash, key in found)

    def take_read_ahead(self) -> list[tuple[BlockHash, KeyDigest]]:
        read_ahead, self._read_ahead = self._read_ahead, []
        return read_ahead

    def complete(self, failed: set[int]) -> None:
        """The step's loads are done: loaded blocks join the prefix cache (held for their request), blocks the
        workers could not read are freed and forgotten on disk, so their tokens are recomputed."""
        for request_id, loads in self._loading.items():
            staged = self._staged[request_id]
            for block, block_hash, key in loads:
                if block.block_id in failed:
                    self.disk.discard(block_hash)
                    self.disk.counters.read_failures += 1
                    self.pool.free([block])
                    continue
                self.disk.counters.hits += 1
                self.pool.cache(block, block_hash, key)
                staged.append(block)
        self._loading.clear()

    def release(self, request_id: str) -> None:
        """Gives back the blocks held for the request (its table holds them now, or it gave up)."""
        staged = self._staged.pop(request_id, None)
        if staged:
            self.pool.free(staged[::-1])

    def forget(self, request_id: str) -> None:
        """The request ended: blocks being read for it and blocks held for it go back."""
        self._read_ahead_for.discard(request_id)
        for block, _, _ in self._loading.pop(request_id, ()):
            self.pool.free([block])
        self.release(request_id)

    def take_loads(self) -> list[tuple[int, BlockHash, KeyDigest]]:
        loads, self._pending = self._pending, []
        return loads

    def take_spills(self) -> list[tuple[int, BlockHash, KeyDigest]]:
        """Every cached block the pool evicted since the last call, unless the disk holds it already, has no
        room, or the pool cached the same hash again meanwhile (the tokens were recomputed: RAM has them)."""
        spills = []
        for block_id, block_hash, key in self.pool.take_evicted():
            if block_hash in self.pool.cached_blocks:
                continue
            digest = key_digest(key)
            if self.disk.add(block_hash, digest):
                spills.append((block_id, block_hash, digest))
        return spills
