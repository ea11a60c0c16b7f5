"""Per-request block tables on top of the block pool: grow on demand, share, copy on write.

A request whose KV holds L tokens owns ceil(L / block_size) table entries; a new
block is taken only when the last one is full. Entries may point at blocks other
requests hold too: prefix-cache hits (full blocks with the same tokens before and
in them) and forks (parallel samples, beams). Full blocks are never written again,
so only a shared, partly filled last block needs copying, and only when a holder
writes into it.

A request's cache salt enters its first block's hash (and key), so requests with
different salts (tenants) never share a cached block, and the same salt shares as before.

With a sliding window (a model whose every layer attends only to a token's last `sliding_window`
keys) the leading blocks that no coming token can see are released as the request grows: its table
keeps their entries (id RELEASED), so a position's entry stays at its index, but holds them no longer;
cached ones stay in the prefix cache until evicted, as any freed block.

A request may pin a computed prefix of its tokens for a while (pin_prefix): the prefix's cached blocks
stay in the pool until the deadline, at most max_pinned_fraction of the pool in all (a longer pin is
shortened to what fits); deadlines are read from an injectable clock.

With a disk tier (kv/disk_tier.py) cached blocks evicted from the pool are spilled to disk, and a waiting
request whose prefix continues on disk has those blocks loaded into free blocks first (load_from_disk, the
blocks kept by kv/disk_loads.py; read ahead while they are not free yet): they are held for it, cached once
loaded, and taken as prefix hits when it is admitted. The manager only decides; `tiers` (kv/tiers.py) says who
waits for blocks and hands the step's spills, loads and deletes to the workers, and complete_disk_loads()
applies what they could not read (those tokens are recomputed).

With a swap space (kv/swap.py) a preempted request may be swapped out instead of recomputed (the records in
kv/swapped_requests.py): its computed blocks are copied out and freed; when it is admitted again, tiers.swap_in
queues their copies back for one step, after which its table and computed tokens are back as they were
(shortened at the first block that could not be read).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from pagedllm.kv.block_pool import (PROCESS_ROOT_HASH, BlockHash, BlockKey, BlockPool, KVBlock, block_key,
                                    blocks_needed, extend_block_hashes)
from pagedllm.kv.disk_tier import DiskTier, key_digest
from pagedllm.kv.swap import SwapSpace
from pagedllm.kv.swapped_requests import SwappedRequest, copied_on_swap
from pagedllm.kv.tiers import KVTiers
from pagedllm.kv.usage import KVCacheUsage, measure_usage


RELEASED = -1   # the block id of a table entry outside the window, given back
# Free blocks kept after a table's new run of blocks for it to grow into (BlockPool.allocate's room): 16 blocks, the
# next 256 tokens of a decode at blocks of 16, beyond most answers; kept only while no other table needs them.
GROWTH_ROOM_BLOCKS = 16


def blocks_outside_window(num_computed_tokens: int, sliding_window: int, block_size: int) -> int:
    """Leading blocks that tokens from position num_computed_tokens on never see: a token at p sees
    keys p - sliding_window + 1 .. p."""
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, max_pinned_fraction: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, disk_tier: DiskTier | None = None,
                 root_hash: bytes | None = None, swap_space: SwapSpace | None = None):
        """disk_tier: the tier below the pool (needs the prefix cache); root_hash: the parent of every first
        block's hash (a disk tier's, stable across restarts; default: the process's random one); swap_space:
        where swap_out puts preempted requests' blocks (None: no swapping)."""
        if not 0 <= max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        if disk_tier is not None and not enable_prefix_caching:
            raise ValueError("a KV disk tier extends the prefix cache: it needs enable_prefix_caching=True")
        self.disk = disk_tier
        self.root_hash = PROCESS_ROOT_HASH if root_hash is None else root_hash
        self.pool = BlockPool(num_blocks, record_evictions=disk_tier is not None)
        self.swap = swap_space
        self.tiers = KVTiers(self.pool, block_size, disk_tier, swap_space)   # what waits, and the step's work
        self.max_pinned_blocks = int(max_pinned_fraction * num_blocks)
        self.clock = clock
        self.block_tables: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept in step with them: the runner reads every running request's
        # table each step, and rebuilding these lists then cost a quarter of the scheduler's time.
        self._block_ids: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}            # tokens whose slots the table covers
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._cache_salts: dict[str, str] = {}           # only requests that have one
        self._num_cached_blocks: dict[str, int] = {}     # leading table entries already in the cache
        self._num_released: dict[str, int] = {}          # leading table entries released (outside the window)
        self._pending_copies: list[tuple[int, int]] = []
        self._rewritten: dict[str, int] = {}   # request id -> first table entry a copy or rollback changed since taken
        # Requests that took part in a fork: only they can hold a shared block that is not yet
        # full (prefix hits are full blocks, never written again), so only their writes need the
        # copy-on-write check, which reads a block object per request per step.
        self._forked: set[str] = set()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def can_ever_fit(self, num_tokens: int) -> bool:
        return blocks_needed(num_tokens, self.block_size) <= self.pool.num_blocks

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block ids: the manager's own list, to read before the next allocation, not change."""
        return self._block_ids[request_id]

    def _block_key(self, request_id: str, token_ids: list[int], index: int, hashes: list[BlockHash]) -> BlockKey:
        """What the request's full block `index` is identified by (its parent's hash must be known)."""
        return block_key(token_ids, index, self.block_size, hashes, self._cache_salts.get(request_id))

    def _hashes(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[BlockHash]:
        """Hashes of the full blocks among the first num_tokens tokens, computed once per block."""
        return extend_block_hashes(self._block_hashes.setdefault(request_id, []), token_ids, num_tokens,
                                   self.block_size, self._cache_salts.get(request_id), self.root_hash)

    def get_computed_blocks(self, request_id: str, token_ids: list[int],
                            cache_salt: str | None = None) -> list[KVBlock]:
        """The cached blocks of the longest cached prefix, leaving at least the last token to compute.
        A block counts only if it was cached under the same parent, tokens and salt."""
        if not self.enable_prefix_caching:
            return []
        if cache_salt is not None:
            self._cache_salts[request_id] = cache_salt
        hits = []
        hashes = self._hashes(request_id, token_ids, len(token_ids) - 1)
        for index, block_hash in enumerate(hashes):
            block = self.pool.lookup(block_hash, self._block_key(request_id, token_ids, index, hashes))
            if block is None:
                break
            hits.append(block)
        return hits

    def load_from_disk(self, request_id: str, token_ids: list[int], ram_hits: list[KVBlock]) -> bool:
        """After get_computed_blocks: if the request's prefix continues on disk and all its blocks are free, takes
        free blocks for those disk blocks, queues their loads for this step and holds the RAM hits too, so
        nothing of the prefix is evicted meanwhile. True when loads were queued: the request waits a step."""
        if self.disk is None or request_id in self.tiers.disk_loads:
            return False
        hashes = self._block_hashes.get(request_id, [])
        found = []
        for index in range(len(ram_hits), len(hashes)):
            key = self._block_key(request_id, token_ids, index, hashes)
            if not self.disk.find(hashes[index], key_digest(key)):
                break
            found.append((hashes[index], key))
        if not found:
            return False
        self.pool.touch(ram_hits)   # before allocating, which could evict them
        # Loads only for a request whose every block is free now: held blocks of requests that could not be
        # admitted would otherwise starve each other, with nothing running to free any.
        if blocks_needed(len(token_ids), self.block_size) - len(ram_hits) > self.pool.num_free_blocks:
            self.pool.free(ram_hits)
            self.tiers.disk_loads.read_ahead(request_id, found)   # while the running requests free blocks
            return False
        self.tiers.disk_loads.start(request_id, ram_hits, found)
        return True

    def complete_disk_loads(self, failed_block_ids: list[int]) -> None:
        """The step's loads and swap-ins are done: loaded blocks join the prefix cache (held for their request),
        blocks the workers could not read are freed and forgotten on disk, so their tokens are recomputed;
        swapped-in requests get their tables back."""
        failed = set(failed_block_ids)
        if self.tiers.disk_loads is not None:
            self.tiers.disk_loads.complete(failed)
        for request_id, record, table, num_tokens in self.tiers.swapped.complete(failed) if self.tiers.swapped else ():
            self._install_swapped_in(request_id, record, table, num_tokens)

    def num_blocks_to_swap(self, request_id: str, num_computed_tokens: int) -> int:
        """How many blocks swap_out would copy: the computed ones but the shared prefix-cache blocks."""
        return sum(1 for block in self._kept_blocks(request_id, num_computed_tokens) if copied_on_swap(block))

    def _kept_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVBlock]:
        table = self.block_tables.get(request_id, [])
        return table[self.num_released_blocks(request_id):blocks_needed(num_computed_tokens, self.block_size)]

    def swap_out(self, request_id: str, num_computed_tokens: int) -> bool:
        """Preempts the request by swapping: the blocks holding its num_computed_tokens tokens are copied out
        in this step (their copies queued) and every block it holds is freed. False, with nothing changed,
        when there is no swap space, nothing computed, or too little room: the caller then frees it to
        recompute."""
        kept = self._kept_blocks(request_id, num_computed_tokens)
        if self.tiers.swapped is None or not kept:
            return False
        entries = self.tiers.swapped.copy_out(kept)
        if entries is None:
            return False
        record = SwappedRequest(num_computed_tokens, self.num_released_blocks(request_id), entries,
                                list(self._block_hashes.get(request_id, [])), self._num_cached_blocks[request_id],
                                self._cache_salts.get(request_id), request_id in self._forked)
        self.free(request_id)
        self.tiers.swapped.park(request_id, record)
        return True

    def _install_swapped_in(self, request_id: str, record: SwappedRequest, table: list[KVBlock],
                            num_tokens: int) -> None:
        """The table of a swapped-in request, as it was when swapped out, cut to the blocks read back."""
        self.block_tables[request_id] = table
        self._block_ids[request_id] = [RELEASED] * record.num_released + [
            block.block_id for block in table[record.num_released:]]
        self.num_tokens[request_id] = num_tokens
        self._block_hashes[request_id] = record.block_hashes
        self._num_cached_blocks[request_id] = min(record.num_cached_blocks, len(table))
        if record.num_released:
            self._num_released[request_id] = record.num_released
        if record.cache_salt is not None:
            self._cache_salts[request_id] = record.cache_salt
        if record.forked:
            self._forked.add(request_id)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one scheduled lookup, for the hit rate (only lookups that led to a run count)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request_id: str, num_total_tokens: int, num_computed_tokens: int,
                       cached_blocks: list[KVBlock] = ()) -> bool:
        """Makes the request's table cover num_total_tokens, after taking `cached_blocks` (prefix
        hits) as its first entries. Copies a shared block that the new tokens would write into.

        Returns False when the pool has too few free blocks, having changed nothing but released the
        blocks outside the window (which no coming token sees either way).
        """
        if self.sliding_window is not None and request_id in self.block_tables:
            self._release_outside_window(request_id, num_computed_tokens)
        table = self.block_tables.get(request_id, [])
        write_index = num_computed_tokens // self.block_size
        needs_copy = (request_id in self._forked and write_index < len(table)
                      and table[write_index].ref_count > 1)
        if num_total_tokens <= len(table) * self.block_size and not needs_copy and not cached_blocks:
            if num_total_tokens > self.num_tokens[request_id]:   # the common decode step: nothing to take
                self.num_tokens[request_id] = num_total_tokens
            return True
        num_new = blocks_needed(num_total_tokens, self.block_size) - len(table) - len(cached_blocks)
        reclaimed = sum(1 for block in cached_blocks if block.is_free)
        if max(num_new, 0) + needs_copy > self.pool.num_free_blocks - reclaimed:
            return False
        block_ids = self._block_ids.setdefault(request_id, [])
        self.pool.touch(list(cached_blocks))
        table.extend(cached_blocks)
        block_ids.extend(block.block_id for block in cached_blocks)
        if needs_copy:
            shared = table[write_index]
            (copy,) = self.pool.allocate(1)
            self._pending_copies.append((shared.block_id, copy.block_id))
            self.pool.free([shared])
            table[write_index] = copy
            block_ids[write_index] = copy.block_id
            self._rewritten[request_id] = min(write_index, self._rewritten.get(request_id, write_index))
        if num_new > 0:
            new_blocks = self.pool.allocate(num_new, after=table[-1] if table else None, room=GROWTH_ROOM_BLOCKS)
            table.extend(new_blocks)
            block_ids.extend(block.block_id for block in new_blocks)
        self.block_tables[request_id] = table
        if self.tiers.disk_loads is not None:
            self.tiers.disk_loads.release(request_id)   # its table holds them now
        self._num_cached_blocks.setdefault(request_id, len(cached_blocks))
        self.num_tokens[request_id] = max(num_total_tokens, self.num_tokens.get(request_id, 0))
        return True

    def _release_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        released = self._num_released.get(request_id, 0)
        outside = blocks_outside_window(num_computed_tokens, self.sliding_window, self.block_size)
        if outside <= released:
            return
        table, block_ids = self.block_tables[request_id], self._block_ids[request_id]
        self.pool.free(table[released:outside][::-1])
        block_ids[released:outside] = [RELEASED] * (outside - released)
        self._num_released[request_id] = outside

    def num_released_blocks(self, request_id: str) -> int:
        """Leading table entries given back because they lie outside the window."""
        return self._num_released.get(request_id, 0)

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Registers the request's blocks that became full and computed, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        if num_full == self._num_cached_blocks[request_id]:
            return
        hashes = self._hashes(request_id, token_ids, num_computed_tokens)
        table = self.block_tables[request_id]
        for index in range(max(self._num_cached_blocks[request_id], self.num_released_blocks(request_id)), num_full):
            self.pool.cache(table[index], hashes[index], self._block_key(request_id, token_ids, index, hashes))
        self._num_cached_blocks[request_id] = num_full

    def pin_prefix(self, request_id: str, token_ids: list[int], num_tokens: int, ttl_s: float) -> int:
        """Pins the cached full blocks among the request's first num_tokens tokens for ttl_s seconds, from
        the first block as far as they are cached and the bound allows; returns the tokens pinned."""
        if not self.enable_prefix_caching:
            return 0
        num_full = num_tokens // self.block_size
        hashes = self._hashes(request_id, token_ids, num_full * self.block_size)
        blocks = []
        for index in range(num_full):
            block = self.pool.lookup(hashes[index], self._block_key(request_id, token_ids, index, hashes))
            if block is None:
                break
            blocks.append(block)
        return self.pool.pin(blocks, self.clock() + ttl_s, self.max_pinned_blocks) * self.block_size

    def expire_pins(self) -> None:
        """Unpins the prefixes whose time is up (cheap when none is)."""
        self.pool.unpin_expired(self.clock())

    def drop_pins_for(self, num_tokens: int) -> bool:
        """Drops pins (the nearest deadline first) until a request of num_tokens new tokens would find its
        blocks free; whether any was dropped. For a request that nothing else would ever make room for."""
        return self.pool.drop_pins_until_free(blocks_needed(num_tokens, self.block_size))

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Shrinks the request's table to cover num_tokens (the verified ones) after a speculative step
        took slots for proposals: slots of rejected tokens are given up, and a block that held only
        rejected tokens goes back to the pool at once. Such blocks were taken for the step, so none is
        cached; full blocks are cached only up to the verified tokens (cache_full_blocks)."""
        table = self.block_tables[request_id]
        keep = blocks_needed(num_tokens, self.block_size)
        if keep < len(table):
            dropped = table[keep:]
            del table[keep:]
            del self._block_ids[request_id][keep:]
            self.pool.free(dropped[::-1])
            self._rewritten[request_id] = min(keep, self._rewritten.get(request_id, keep))
        self.num_tokens[request_id] = min(self.num_tokens[request_id], num_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Gives the child the parent's table: every block shared, one more reference each."""
        table = list(self.block_tables[parent_id])
        released = self.num_released_blocks(parent_id)
        self.pool.touch(table[released:])
        if released:
            self._num_released[child_id] = released
        self.block_tables[child_id] = table
        self._block_ids[child_id] = list(self._block_ids[parent_id])
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        self._block_hashes[child_id] = list(self._block_hashes.get(parent_id, []))
        self._num_cached_blocks[child_id] = self._num_cached_blocks[parent_id]
        if parent_id in self._cache_salts:
            self._cache_salts[child_id] = self._cache_salts[parent_id]
        self._forked.update((parent_id, child_id))

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies the runner must make before the next forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def rewritten_entries(self) -> dict[str, int]:
        """What take_rewritten_entries would return now: the manager's own dict, to read before that call, not change."""
        return self._rewritten

    def take_rewritten_entries(self) -> dict[str, int]:
        """Request id -> first block-table entry replaced by a copy or dropped by a rollback since the last call
        (tables otherwise only grow), so a step can send the workers just the entries that changed."""
        rewritten, self._rewritten = self._rewritten, {}
        return rewritten

    def free(self, request_id: str) -> None:
        """Releases the request's blocks, last block first so a prefix's head stays cached longest."""
        table = self.block_tables.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        self.num_tokens.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self._cache_salts.pop(request_id, None)
        self._forked.discard(request_id)
        self._rewritten.pop(request_id, None)
        released = self._num_released.pop(request_id, 0)
        if self.tiers.disk_loads is not None:
            self.tiers.disk_loads.forget(request_id)
        if table:
            self.pool.free(table[released:][::-1])
        if self.tiers.swapped is not None:
            self.tiers.swapped.forget(request_id)

    def usage(self) -> KVCacheUsage:
        """The figures now; pins whose time is up are dropped first (an idle engine runs no step to do it)."""
        self.expire_pins()
        return measure_usage(self.pool, {request_id: table[self.num_released_blocks(request_id):]
                                         for request_id, table in self.block_tables.items()},
                             {request_id: self.num_released_blocks(request_id) for request_id in self.block_tables},
                             self.num_tokens, self.block_size, self.prefix_cache_queries, self.prefix_cache_hits)
