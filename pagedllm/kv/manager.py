"""Per-request block tables on top of the block pool."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVCacheUsage:
    """Figures derived from the pool and the block tables at one instant."""
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_tokens_stored: int
    block_size: int

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (what vLLM reports as KV-cache usage)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def utilization(self) -> float:
        """Tokens stored / slots in used blocks: how much of the taken memory holds real KV."""
        slots = self.num_used_blocks * self.block_size
        return self.num_tokens_stored / slots if slots else 1.0


class KVCacheManager:
    """Maps each request's logical blocks to physical ones, growing on demand.

    A request whose KV holds L tokens owns exactly ceil(L / block_size) blocks:
    a new block is taken only when the last one is full.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}

    def can_ever_fit(self, num_tokens: int) -> bool:
        return blocks_needed(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Makes the request's table cover `num_total_tokens` tokens.

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        table = self.block_tables.setdefault(request_id, [])
        missing = blocks_needed(num_total_tokens, self.block_size) - len(table)
        if missing > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request_id]
            return False
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        self.num_tokens[request_id] = max(num_total_tokens, self.num_tokens.get(request_id, 0))
        return True

    def free(self, request_id: str) -> None:
        """Releases the request's blocks, last block first so the earliest stay warm longest."""
        table = self.block_tables.pop(request_id, None)
        self.num_tokens.pop(request_id, None)
        if table:
            self.pool.free(table[::-1])

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def usage(self) -> KVCacheUsage:
        return KVCacheUsage(
            num_blocks=self.pool.num_blocks,
            num_used_blocks=self.pool.num_used_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_tokens_stored=sum(self.num_tokens.values()),
            block_size=self.block_size,
        )
