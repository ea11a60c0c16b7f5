"""KV cache figures derived from the pool and the block tables at one instant (llm.stats(), /metrics)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.block_pool import BlockPool, KVBlock


@dataclass(frozen=True)
class KVCacheUsage:
    """Figures derived from the pool and the block tables at one instant."""
    num_blocks: int
    num_used_blocks: int        # held by at least one request or pin
    num_free_blocks: int        # held by none (cached-idle ones included)
    num_pinned_blocks: int      # held by a pin (a request may hold them too)
    num_cached_idle_blocks: int  # free, but still holding reusable prefix KV
    num_shared_blocks: int      # held by more than one request
    num_logical_blocks: int     # table entries over all requests: what no sharing would need
    num_tokens_stored: int      # filled slots in used blocks
    block_size: int
    prefix_cache_queries: int   # prompt tokens looked up in the prefix cache, ever
    prefix_cache_hits: int      # of those, tokens found

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (what vLLM reports as KV-cache usage)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def utilization(self) -> float:
        """Filled slots / slots in used blocks: how much of the taken memory holds real KV."""
        slots = self.num_used_blocks * self.block_size
        return self.num_tokens_stored / slots if slots else 1.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def measure_usage(pool: BlockPool, held: dict[str, list[KVBlock]], first_index: dict[str, int],
                  num_tokens: dict[str, int], block_size: int, prefix_cache_queries: int,
                  prefix_cache_hits: int) -> KVCacheUsage:
    """held: each request's table entries it still holds (those outside a window left out), the first of them
    at table index first_index[request]; num_tokens: the tokens each table covers."""
    filled: dict[int, int] = {}
    for request_id, blocks in held.items():
        for index, block in enumerate(blocks, first_index[request_id]):
            slots = min(block_size, num_tokens[request_id] - index * block_size)
            filled[block.block_id] = max(filled.get(block.block_id, 0), slots)
    return KVCacheUsage(
        num_blocks=pool.num_blocks,
        num_used_blocks=pool.num_used_blocks,
        num_free_blocks=pool.num_free_blocks,
        num_pinned_blocks=pool.num_pinned_blocks,
        num_cached_idle_blocks=pool.num_cached_idle_blocks(),
        num_shared_blocks=sum(1 for block in pool.blocks if block.ref_count > 1),
        num_logical_blocks=sum(len(blocks) for blocks in held.values()),
        num_tokens_stored=sum(filled.values()),
        block_size=block_size,
        prefix_cache_queries=prefix_cache_queries,
        prefix_cache_hits=prefix_cache_hits,
    )
