"""Physical KV blocks: reference counts, an O(1) free queue, and the prefix cache.

Pure bookkeeping, no tensors: a block id indexes the first dimension of the
per-layer KV cache tensors owned by the model runner.

A block is free exactly when no request holds it (ref_count 0). A free block may
still hold the KV of a full block that some request computed; it stays findable
by its content hash until it is handed out again, so the free queue doubles as
the LRU list of the prefix cache: blocks are taken from the front (least recently
released first) and cached ones released to the back. A released block that holds
nothing findable goes to the front instead, to be written again before the blocks no
request has written yet (see free).

A cached block is found by its hash but handed out only if the key it was cached
under (parent hash, token ids, extra key) equals the one asked for, so a hash
collision, accidental or crafted, can never give one request another's KV.

A pin keeps a cached prefix's blocks out of the free queue until its deadline (Anthropic's
cache_control): a block is evictable only when neither a request nor a pin holds it. Pins are
counted per block apart from ref_count, so they compose with each other and with running requests.
"""
from __future__ import annotations

import hashlib
import math
import secrets
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from pagedllm.kv.hash_log import RAM, BlockHashLog

BlockHash = bytes
# What a full block's hash is computed over: the parent block's hash (None for the first block),
# the block's token ids, and an extra key (the request's cache salt, first block only).
BlockKey = tuple[BlockHash | None, tuple[int, ...], str | None]

# The parent of every first block: random per process, so no one outside can precompute a chain
# (vLLM's advisory GHSA-rm76-4mrf-v9r8: a constant root made crafted collisions possible). A secret: never logged;
# only a data-parallel router of the same deployment is told it, to hash prompts into this process's chains.
PROCESS_ROOT_HASH = secrets.token_bytes(32)


class KVBlock:
    __slots__ = ("block_id", "ref_count", "pin_count", "block_hash", "block_key", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.pin_count = 0   # live pins covering the block (pins of different prefixes may share it)
        self.block_hash: BlockHash | None = None
        self.block_key: BlockKey | None = None    # set with block_hash, while the block is cached
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:12] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref_count={self.ref_count}, pin_count={self.pin_count}, hash={digest})"

    @property
    def is_free(self) -> bool:
        """Held by no request and no pin: in the free queue, evictable."""
        return self.ref_count == 0 and self.pin_count == 0


@dataclass
class PrefixPin:
    """A cached prefix's blocks, kept until `deadline` (on the clock of whoever pinned them)."""
    blocks: list[KVBlock]
    deadline: float


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def hash_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...], extra_key: str | None = None,
               root_hash: bytes = PROCESS_ROOT_HASH) -> BlockHash:
    """sha256 of a full block's identity in a canonical, unambiguous encoding: the parent's digest (root_hash
    for a first block), the token count and ids (4-byte little-endian), then a tag and the extra key's UTF-8
    bytes. A disk tier passes its directory's own secret root, so that its chains outlive the process."""
    digest = hashlib.sha256(root_hash if parent_hash is None else parent_hash)
    digest.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    digest.update(b"\x00" if extra_key is None else b"\x01" + extra_key.encode())
    return digest.digest()


def block_key(token_ids: list[int], index: int, block_size: int, hashes: list[BlockHash],
              extra_key: str | None) -> BlockKey:
    """What full block `index` of a token sequence is identified by (its parent's hash, hashes[index - 1], known);
    the extra key enters the first block only, and through it the whole chain."""
    block_tokens = tuple(token_ids[index * block_size:(index + 1) * block_size])
    if index == 0:
        return None, block_tokens, extra_key
    return hashes[index - 1], block_tokens, None


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], num_tokens: int, block_size: int,
                        extra_key: str | None, root_hash: bytes = PROCESS_ROOT_HASH) -> list[BlockHash]:
    """Appends to `hashes` those of the full blocks among the first num_tokens tokens that it lacks: the one chain
    the KV manager caches blocks under and a data-parallel router hashes prompts into."""
    for index in range(len(hashes), num_tokens // block_size):
        hashes.append(hash_block(*block_key(token_ids, index, block_size, hashes, extra_key), root_hash=root_hash))
    return hashes


class FreeBlockQueue:
    """A doubly linked list of free blocks: pop the front, push either end, unlink any block, all O(1). Blocks
    holding a cached prefix sit behind all others: `append` puts a cached block at the back and one holding
    nothing just before the first cached one, so the blocks holding nothing are handed out before any cached
    block is evicted."""

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._first_cached = self._tail   # the tail sentinel while no free block holds a cached prefix
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free KV block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self._insert_after(self._first_cached.prev_free, block)
        else:
            self._insert_after(self._tail.prev_free, block)
            if self._first_cached is self._tail:
                self._first_cached = block

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, previous: KVBlock, block: KVBlock) -> None:
        following = previous.next_free
        previous.next_free, block.prev_free = block, previous
        block.next_free, following.prev_free = following, block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        if block is self._first_cached:
            self._first_cached = block.next_free
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, record_evictions: bool = False):
        """record_evictions: keep (block id, hash, key) of each cached block that allocate() evicts, for a
        tier below to take (take_evicted) before the block is written again."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        self.pins: dict[BlockHash, PrefixPin] = {}   # by the hash of the prefix's last block
        self.num_pinned_blocks = 0                    # blocks with pin_count > 0
        self._next_deadline = math.inf                # no pin expires before this (it may be earlier than any)
        self.evicted: list[tuple[int, BlockHash, BlockKey]] | None = [] if record_evictions else None
        self.hash_log: BlockHashLog | None = None   # records hashes entering and leaving the cache, when set

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request or pin holds, idle cached ones included (they are evicted on demand)."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, count: int, after: KVBlock | None = None, room: int = 0) -> list[KVBlock]:
        """Takes `count` free blocks (evicting their cached content), each with ref_count 1.

        after: the last block of the table they extend. The blocks right after it are taken first, while they
        are free and hold nothing cached, so that a sequence's blocks lie side by side: decode attention reads
        a sequence's blocks at twice the rate where each follows the one before in memory (the hardware's
        prefetchers follow them; docs/kv-cache.md, "Blocks side by side"). room: where the last block came from
        the front of the queue (a new run), up to this many free blocks right after it that hold nothing go to
        the end of the blocks holding nothing, so that other tables take them last and this one grows into them.
        """
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks but only {self.num_free_blocks} are free")
        blocks = self._free_empty_run(after.block_id + 1, count) if after is not None else []
        for block in blocks:
            self.free_block_queue.remove(block)
        num_adjacent = len(blocks)
        blocks.extend(self.free_block_queue.popleft() for _ in range(count - num_adjacent))
        for block in blocks:
            if block.block_hash is not None:
                if self.evicted is not None:
                    self.evicted.append((block.block_id, block.block_hash, block.block_key))
                if self.hash_log is not None:
                    self.hash_log.record(block.block_hash, RAM, False)
                del self.cached_blocks[block.block_hash]
                block.block_hash = block.block_key = None
            block.ref_count = 1
        if room > 0 and len(blocks) > num_adjacent:
            for block in self._free_empty_run(blocks[-1].block_id + 1, room):
                self.free_block_queue.remove(block)
                self.free_block_queue.append(block)
        return blocks

    def _free_empty_run(self, first_id: int, limit: int) -> list[KVBlock]:
        """The free blocks holding nothing cached from block first_id on, up to limit, stopping at the first other."""
        run = []
        for block in self.blocks[first_id:first_id + limit]:
            if not block.is_free or block.block_hash is not None:
                break
            run.append(block)
        return run

    def take_evicted(self) -> list[tuple[int, BlockHash, BlockKey]]:
        """The cached blocks evicted since the last call (recorded only with record_evictions)."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes one more reference on each block (a prefix-cache hit or a fork)."""
        for block in blocks:
            if block.is_free:
                self.free_block_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drops one reference from each block. A block nobody holds joins the back of the free queue if it
        holds a cached prefix (evicted last, least recently freed first), and the front if it holds nothing
        to keep: it is handed out again before any block never written, whose pages the OS has not given
        yet (a first write to a page of a fresh cache cost 6x a later one here: a 32,768-token prefill chunk's
        K/V write took 83-97 ms a layer into fresh pages, 14 ms into written ones), so the cache's memory
        grows with what the workload holds at once, not with what it has held in all."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than it was taken")
            block.ref_count -= 1
            if block.is_free:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def lookup(self, block_hash: BlockHash, block_key: BlockKey) -> KVBlock | None:
        """The cached block with this hash, only if it was cached under the same key."""
        block = self.cached_blocks.get(block_hash)
        return block if block is not None and block.block_key == block_key else None

    def cache(self, block: KVBlock, block_hash: BlockHash, block_key: BlockKey) -> None:
        """Makes a full, computed block findable by its hash (the first block with a given hash wins)."""
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash, block.block_key = block_hash, block_key
            self.cached_blocks[block_hash] = block
            if self.hash_log is not None:
                self.hash_log.record(block_hash, RAM, True)

    def num_cached_idle_blocks(self) -> int:
        """Free blocks that still hold reusable prefix KV (derived by a walk; for stats, not hot paths)."""
        return sum(1 for block in self.free_block_queue if block.block_hash is not None)

    def pin(self, blocks: list[KVBlock], deadline: float, max_pinned_blocks: int) -> int:
        """Pins a cached prefix's leading blocks until `deadline`, as many as keep the pinned blocks within
        max_pinned_blocks (blocks pinned already cost nothing); returns how many. Pinning a prefix that is
        pinned already moves its deadline out, never in."""
        room = max_pinned_blocks - self.num_pinned_blocks
        num_kept = 0
        for block in blocks:
            if block.block_hash is None:
                raise RuntimeError(f"KV block {block.block_id} is not in the prefix cache: only cached blocks pin")
            if block.pin_count == 0:
                if room == 0:
                    break
                room -= 1
            num_kept += 1
        if num_kept == 0:
            return 0
        kept = blocks[:num_kept]
        existing = self.pins.get(kept[-1].block_hash)
        if existing is not None:
            existing.deadline = max(existing.deadline, deadline)
            return num_kept
        for block in kept:
            if block.pin_count == 0:
                if block.ref_count == 0:
                    self.free_block_queue.remove(block)
                self.num_pinned_blocks += 1
            block.pin_count += 1
        self.pins[kept[-1].block_hash] = PrefixPin(kept, deadline)
        self._next_deadline = min(self._next_deadline, deadline)
        return num_kept

    def unpin_expired(self, now: float) -> None:
        """Drops the pins whose deadline has come: their blocks are evictable again unless held otherwise."""
        if now < self._next_deadline:   # every step asks; most steps nothing expires
            return
        for key in [key for key, pin in self.pins.items() if pin.deadline <= now]:
            self._unpin(key)
        self._next_deadline = min((pin.deadline for pin in self.pins.values()), default=math.inf)

    def drop_pins_until_free(self, num_blocks: int) -> bool:
        """Drops pins, the nearest deadline first, until num_blocks blocks are free or no pin is left;
        whether any was dropped."""
        dropped = False
        for key in sorted(self.pins, key=lambda key: self.pins[key].deadline):
            if self.num_free_blocks >= num_blocks:
                break
            self._unpin(key)
            dropped = True
        return dropped

    def _unpin(self, key: BlockHash) -> None:
        """Last block first back to the free queue, so that a prefix's head stays cached longest."""
        for block in reversed(self.pins.pop(key).blocks):
            block.pin_count -= 1
            if block.pin_count == 0:
                self.num_pinned_blocks -= 1
                if block.ref_count == 0:
                    self.free_block_queue.append(block)
