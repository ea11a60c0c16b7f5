"""Physical KV blocks: a free list and reference counts.

Pure bookkeeping, no tensors: a block id indexes the first dimension of the
per-layer KV cache tensors owned by the model runner.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out physical block ids and takes them back when no one uses them.

    A block is free exactly when its reference count is zero; the free list
    holds those ids in the order they were released, so allocation is O(1).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_block_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, count: int) -> list[int]:
        """Takes `count` free blocks, each with a reference count of one."""
        if count > len(self.free_block_queue):
            raise RuntimeError(
                f"asked for {count} KV blocks but only {len(self.free_block_queue)} are free")
        block_ids = [self.free_block_queue.popleft() for _ in range(count)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference from each block; blocks nobody holds go back to the free list."""
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"KV block {block_id} freed more often than it was taken")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self.free_block_queue.append(block_id)
