"""Physical KV blocks: reference counts, an O(1) free queue, and the prefix cache.

Pure bookkeeping, no tensors: a block id indexes the first dimension of the
per-layer KV cache tensors owned by the model runner.

A block is free exactly when no request holds it (ref_count 0). A free block may
still hold the KV of a full block that some request computed; it stays findable
by its content hash until it is handed out again, so the free queue doubles as
the LRU list of the prefix cache: blocks are taken from the front (least recently
released first) and released to the back.

A cached block is found by its hash but handed out only if the key it was cached
under (parent hash, token ids, extra key) equals the one asked for, so a hash
collision, accidental or crafted, can never give one request another's KV.
"""
from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Iterator

BlockHash = bytes
# What a full block's hash is computed over: the parent block's hash (None for the first block),
# the block's token ids, and an extra key (the request's cache salt, first block only).
BlockKey = tuple[BlockHash | None, tuple[int, ...], str | None]

# The parent of every first block: random per process, so no one outside can precompute a chain
# (vLLM's advisory GHSA-rm76-4mrf-v9r8: a constant root made crafted collisions possible).
_ROOT_HASH = secrets.token_bytes(32)


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "block_key", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.block_key: BlockKey | None = None    # set with block_hash, while the block is cached
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:12] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref_count={self.ref_count}, hash={digest})"


def hash_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...], extra_key: str | None = None) -> BlockHash:
    """sha256 of a full block's identity in a canonical, unambiguous encoding: the parent's digest,
    the token count and ids (4-byte little-endian), then a tag and the extra key's UTF-8 bytes."""
    digest = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    digest.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    digest.update(b"\x00" if extra_key is None else b"\x01" + extra_key.encode())
    return digest.digest()


class FreeBlockQueue:
    """A doubly linked list of free blocks: pop the front, push the back, unlink any block, all O(1)."""

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
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
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
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
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, idle cached ones included (they are evicted on demand)."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, count: int) -> list[KVBlock]:
        """Takes `count` free blocks (evicting their cached content), each with ref_count 1."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks but only {self.num_free_blocks} are free")
        blocks = [self.free_block_queue.popleft() for _ in range(count)]
        for block in blocks:
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                block.block_hash = block.block_key = None
            block.ref_count = 1
        return blocks

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes one more reference on each block (a prefix-cache hit or a fork)."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_block_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drops one reference from each block; blocks nobody holds join the back of the free queue."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
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

    def num_cached_idle_blocks(self) -> int:
        """Free blocks that still hold reusable prefix KV (derived by a walk; for stats, not hot paths)."""
        return sum(1 for block in self.free_block_queue if block.block_hash is not None)
