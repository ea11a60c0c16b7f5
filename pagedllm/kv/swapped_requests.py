"""Preempted requests swapped out of the pool: what their tables were, and their way back in.

A swap-out copies a request's computed blocks out (except shared prefix-cache blocks, found again by their hash)
and records its table; a swap-in takes fresh blocks for the copies and queues them back for one step, after which
the manager installs the table again (shortened at the first block that could not be read). The manager owns the
tables (kv/manager.py); the room is the swap space's (kv/swap.py); the workers move the bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.block_pool import BlockHash, BlockKey, BlockPool, KVBlock, blocks_needed
from pagedllm.kv.swap import SwapKey, SwapSpace


@dataclass
class SwapEntry:
    """One table entry of a swapped-out request."""
    key: SwapKey | None             # where its copy is; None: a shared prefix-cache block, found again by hash
    block_hash: BlockHash | None    # set when the block was in the prefix cache
    block_key: BlockKey | None


@dataclass
class SwappedRequest:
    """What a swapped-out request's table was, to rebuild it when it is swapped in."""
    num_tokens: int                 # computed tokens whose KV was kept
    num_released: int               # leading entries outside the window (nothing kept)
    entries: list[SwapEntry]        # the entries from num_released on, covering num_tokens
    block_hashes: list[BlockHash]
    num_cached_blocks: int
    cache_salt: str | None
    forked: bool

    @property
    def keys(self) -> list[SwapKey]:
        return [entry.key for entry in self.entries if entry.key is not None]


@dataclass
class SwapIn:
    """A swap-in in flight: the table being rebuilt (placeholders for released entries first) and the blocks
    whose copies are read back in this step."""
    record: SwappedRequest
    table: list[KVBlock]
    copied_back: list[KVBlock]


# The table entry of a released block in a swapped-in table: never freed, cached or read.
RELEASED_BLOCK = KVBlock(-1)


def copied_on_swap(block: KVBlock) -> bool:
    """Only a block someone else holds and the prefix cache can find again stays behind."""
    return block.ref_count == 1 or block.block_hash is None


class SwappedRequests:
    def __init__(self, pool: BlockPool, space: SwapSpace, block_size: int):
        self.pool = pool
        self.space = space
        self.block_size = block_size
        self._swapped: dict[str, SwappedRequest] = {}
        self._swapping_in: dict[str, SwapIn] = {}
        self._restored: dict[str, int] = {}   # swapped in, not yet admitted: request id -> its computed tokens
        self._pending_outs: list[tuple[int, SwapKey]] = []
        self._pending_ins: list[tuple[int, SwapKey]] = []
        self._pending_drops: list[SwapKey] = []

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def is_swapping_in(self, request_id: str) -> bool:
        return request_id in self._swapping_in

    def restored_tokens(self, request_id: str) -> int | None:
        return self._restored.get(request_id)

    def take_restored(self, request_id: str) -> None:
        self._restored.pop(request_id, None)

    def copy_out(self, kept: list[KVBlock]) -> list[SwapEntry] | None:
        """Reserves room for the kept blocks that must be copied and queues their copies; their entries, or
        None (nothing reserved) when they do not fit."""
        copied = [block for block in kept if copied_on_swap(block)]
        if not self.space.reserve(len(copied)):
            return None
        keys = iter(self.space.new_keys(len(copied)))
        entries = []
        for block in kept:
            key = next(keys) if copied_on_swap(block) else None
            if key is not None:
                self._pending_outs.append((block.block_id, key))
            entries.append(SwapEntry(key, block.block_hash, block.block_key))
        self.space.counters.swap_outs += 1
        self.space.counters.blocks_out += len(copied)
        return entries

    def park(self, request_id: str, record: SwappedRequest) -> None:
        """The request's blocks are freed: its record waits for swap_in."""
        self._swapped[request_id] = record

    def swap_in(self, request_id: str, num_tokens: int) -> bool:
        """Starts bringing a swapped-out request of num_tokens tokens back: blocks the prefix cache still holds
        are taken as they are, fresh blocks are taken for the copies, which are read back in this step. Only
        when every block the request needs is free now; False, with nothing changed, otherwise."""
        record = self._swapped.get(request_id)
        if record is None:
            return False
        plan: list[tuple[SwapEntry, KVBlock | None]] = []
        for entry in record.entries:
            block = self.pool.lookup(entry.block_hash, entry.block_key) if entry.block_hash is not None else None
            if block is None and entry.key is None:
                break   # a shared block gone from the cache: the tokens from here on are recomputed
            plan.append((entry, block))
        hits = [block for _, block in plan if block is not None]
        held_elsewhere = sum(1 for block in hits if not block.is_free)
        needed = blocks_needed(num_tokens, self.block_size) - record.num_released - held_elsewhere
        if needed > self.pool.num_free_blocks:
            return False
        del self._swapped[request_id]
        self.pool.touch(hits)   # before allocating, which could evict them
        fresh = iter(self.pool.allocate(len(plan) - len(hits)))
        table, copied_back, used_keys = [RELEASED_BLOCK] * record.num_released, [], set()
        for entry, block in plan:
            if block is None:
                block = next(fresh)
                copied_back.append(block)
                self._pending_ins.append((block.block_id, entry.key))
                used_keys.add(entry.key)
            table.append(block)
        self._pending_drops.extend(key for key in record.keys if key not in used_keys)
        self.space.counters.blocks_reused += sum(1 for entry, block in plan
                                                 if entry.key is not None and block is not None)
        self.space.release(len(record.keys))
        self._swapping_in[request_id] = SwapIn(record, table, copied_back)
        return True

    def complete(self, failed: set[int]) -> list[tuple[str, SwappedRequest, list[KVBlock], int]]:
        """The step's swap-ins are read back: per request, its record, the table kept up to the first block that
        could not be read (all of it gone with a window, whose released blocks cannot be recomputed alone) and
        its computed tokens, for the manager to install; a request that kept nothing is left out (it is
        admitted as a new one)."""
        installs = []
        for request_id, swap_in in self._swapping_in.items():
            record, table = swap_in.record, swap_in.table
            num_failed = sum(1 for block in swap_in.copied_back if block.block_id in failed)
            num_kept = len(table)
            if num_failed:
                num_kept = 0 if record.num_released else min(
                    index for index, block in enumerate(table)
                    if block in swap_in.copied_back and block.block_id in failed)
            counters = self.space.counters
            counters.failed_blocks += num_failed
            counters.swap_ins += 1
            counters.blocks_in += len(swap_in.copied_back) - num_failed
            self.pool.free(table[max(num_kept, record.num_released):][::-1])
            num_tokens = min(record.num_tokens, num_kept * self.block_size)
            if num_tokens == 0:
                continue
            for entry, block in zip(record.entries, table[record.num_released:num_kept]):
                if entry.block_hash is not None and block in swap_in.copied_back:
                    self.pool.cache(block, entry.block_hash, entry.block_key)
            self._restored[request_id] = num_tokens
            installs.append((request_id, record, table[:num_kept], num_tokens))
        self._swapping_in.clear()
        return installs

    def forget(self, request_id: str) -> None:
        """The request ended: its copies are dropped, a swap-in in flight gives its blocks back."""
        self._restored.pop(request_id, None)
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            self._pending_drops.extend(swapped.keys)
            self.space.release(len(swapped.keys))
        swap_in = self._swapping_in.pop(request_id, None)
        if swap_in is not None:   # its copies are read back in this step, into blocks freed here
            self.pool.free(swap_in.table[swap_in.record.num_released:][::-1])

    def take_work(self) -> tuple[list[tuple[int, SwapKey]], list[tuple[int, SwapKey]], list[SwapKey]]:
        """(copies out, copies back in, copies dropped) queued since the last call."""
        work = self._pending_outs, self._pending_ins, self._pending_drops
        self._pending_outs, self._pending_ins, self._pending_drops = [], [], []
        return work
