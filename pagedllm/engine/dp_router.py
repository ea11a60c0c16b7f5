"""Where a data-parallel request goes: to the replica that holds the longest cached prefix of its prompt, unless that
replica is busier than the least loaded one by more than a bound; otherwise to the least loaded replica.

The router hashes the prompt into the replicas' own block-hash chains (same block size, root and first-block key as
their KV managers, through kv/block_pool.extend_block_hashes) and compares the hashes with its mirror of what each
replica's prefix cache and disk tier hold, kept current from the replicas' reports. No Ray here: the rule is tested
with fake reports. The rule and its bound are explained in docs/distributed.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.block_pool import extend_block_hashes
from pagedllm.kv.hash_log import BlockHashEvent, short_hash

# Why a request went where it went. prefix: the replica with the longest cached prefix of its prompt; balance: a
# replica held a longer prefix but was over the imbalance bound; load: no replica held a block of the prompt (or the
# routing is least-loaded), so the least loaded.
PREFIX, BALANCE, LOAD = "prefix", "balance", "load"
ROUTING_REASONS = (PREFIX, BALANCE, LOAD)


@dataclass(frozen=True)
class BlockHashReport:
    """A replica's cached-hash changes since its last report (kv/hash_log.py); at the first report, or when its
    log overflowed, the whole state (short hash -> tier bits) comes first."""
    events: list[BlockHashEvent]
    snapshot: dict[int, int] | None = None


class CachedBlocksMirror:
    """The router's copy of which block hashes one replica holds, in RAM or on disk."""

    def __init__(self):
        self.held: dict[int, int] = {}   # short hash -> tier bits

    def apply(self, report: BlockHashReport) -> None:
        if report.snapshot is not None:
            self.held = report.snapshot
        for key, tier, held in report.events:
            bits = self.held.get(key, 0)
            bits = bits | tier if held else bits & ~tier
            if bits:
                self.held[key] = bits
            else:
                self.held.pop(key, None)

    def num_leading_held(self, hashes: list[int]) -> int:
        """How many of the chain's first blocks the replica holds, up to the first it lacks."""
        for count, key in enumerate(hashes):
            if key not in self.held:
                return count
        return len(hashes)


def prompt_block_hashes(token_ids: list[int], extra_key: str | None, block_size: int, root_hash: bytes) -> list[int]:
    """Short hashes of the prompt's full blocks that a prefix hit can cover: those before its last token, which is
    always computed (as KVCacheManager.get_computed_blocks looks them up)."""
    return [short_hash(block_hash) for block_hash in
            extend_block_hashes([], token_ids, len(token_ids) - 1, block_size, extra_key, root_hash)]


@dataclass(frozen=True)
class RouteCandidate:
    index: int
    num_in_flight: int       # requests sent to it and not finished: its load
    num_routed: int          # requests ever sent to it
    num_cached_blocks: int   # leading blocks of the prompt it holds


def choose_replica(candidates: list[RouteCandidate], balance_abs_threshold: int) -> tuple[RouteCandidate, str]:
    """The replica for a request, and why (ROUTING_REASONS). A replica holding part of the prompt is a candidate for
    affinity only while its load exceeds the least loaded replica's by at most balance_abs_threshold; among those the
    longest cached prefix wins, ties going to the less loaded (then the one given fewer so far)."""
    least_loaded = min(candidates, key=lambda c: (c.num_in_flight, c.num_routed))
    longest = max(c.num_cached_blocks for c in candidates)
    if longest == 0:
        return least_loaded, LOAD
    within_bound = [c for c in candidates if c.num_cached_blocks
                    and c.num_in_flight - least_loaded.num_in_flight <= balance_abs_threshold]
    if not within_bound:
        return least_loaded, BALANCE
    best = max(within_bound, key=lambda c: (c.num_cached_blocks, -c.num_in_flight, -c.num_routed))
    return best, PREFIX if best.num_cached_blocks == longest else BALANCE
