"""The disk tier's bookkeeping: which block hashes have a file, in LRU order, within a quota of blocks.

No I/O here: the manager decides what to spill, load and delete, and the worker's DiskKVStore
(pagedllm/worker/kv_disk_store.py) moves the bytes. An entry keeps the digest of the block's key
(parent hash, token ids, salt) beside its hash, so a disk hit needs the same key a RAM hit does.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.kv.block_pool import BlockHash, BlockKey
from pagedllm.kv.hash_log import DISK, BlockHashLog

KeyDigest = bytes


def key_digest(block_key: BlockKey) -> KeyDigest:
    """A second, independent digest of a block's key (blake2b, not the chain's sha256), kept on disk
    instead of the key itself, so files hold no salt in the clear."""
    parent, token_ids, extra_key = block_key
    digest = hashlib.blake2b(digest_size=32)
    digest.update(b"\x00" * 32 if parent is None else parent)
    digest.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    digest.update(b"\x00" if extra_key is None else b"\x01" + extra_key.encode())
    return digest.digest()


@dataclass
class DiskTierCounters:
    """Since start-up, in blocks."""
    hits: int = 0           # blocks read back into RAM
    read_failures: int = 0  # files that were missing or failed their checksum (their tokens are recomputed)
    spills: int = 0         # blocks written
    evictions: int = 0      # files deleted to stay within the quota


class DiskTier:
    def __init__(self, capacity_blocks: int, entries: list[tuple[BlockHash, KeyDigest]] = ()):
        """entries: the files found at start-up, least recently used first (beyond capacity: the oldest go)."""
        if capacity_blocks < 0:
            raise ValueError(f"the disk tier's capacity must be >= 0 blocks, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.num_reserved = 0   # blocks of swapped-out requests (kv/swap.py): never evicted, they count too
        self.entries: OrderedDict[BlockHash, KeyDigest] = OrderedDict(entries)
        self.counters = DiskTierCounters()
        self.hash_log: BlockHashLog | None = None   # records hashes entering and leaving the tier, when set
        self._pending_deletes: list[BlockHash] = []
        self._evict_to(capacity_blocks)

    def __len__(self) -> int:
        """Cached block files (swapped blocks are not counted)."""
        return len(self.entries)

    @property
    def room(self) -> int:
        """Cached block files the quota allows beside the swapped blocks."""
        return self.capacity_blocks - self.num_reserved

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def find(self, block_hash: BlockHash, digest: KeyDigest) -> bool:
        """Whether the block is on disk under this key; a find makes it the most recently used."""
        if self.entries.get(block_hash) != digest:
            return False
        self.entries.move_to_end(block_hash)
        return True

    def add(self, block_hash: BlockHash, digest: KeyDigest) -> bool:
        """Records a block about to be written; False (nothing to write) when it is there already or the
        quota holds no block at all. The least recently used files make room."""
        if block_hash in self.entries or self.room == 0:
            return False
        self._evict_to(self.room - 1)
        self.entries[block_hash] = digest
        self.counters.spills += 1
        if self.hash_log is not None:
            self.hash_log.record(block_hash, DISK, True)
        return True

    def discard(self, block_hash: BlockHash) -> None:
        """Forgets a block whose file could not be read (the store has removed it)."""
        if self.entries.pop(block_hash, None) is not None and self.hash_log is not None:
            self.hash_log.record(block_hash, DISK, False)

    def reserve(self, num_blocks: int) -> None:
        """Takes quota for swapped blocks (the caller checked it fits), evicting cached files to make room."""
        self.num_reserved += num_blocks
        self._evict_to(self.room)

    def release(self, num_blocks: int) -> None:
        self.num_reserved -= num_blocks

    def take_deletes(self) -> list[BlockHash]:
        deletes, self._pending_deletes = self._pending_deletes, []
        return deletes

    def _evict_to(self, num_blocks: int) -> None:
        while len(self.entries) > num_blocks:
            block_hash, _ = self.entries.popitem(last=False)
            self._pending_deletes.append(block_hash)
            self.counters.evictions += 1
            if self.hash_log is not None:
                self.hash_log.record(block_hash, DISK, False)
