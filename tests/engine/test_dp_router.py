"""The data-parallel router without Ray: the choice rule on hand-made candidates, and the block-hash mirror fed by
real KVCacheManagers' reports (the manager's own prefix lookup is the reference for what a replica holds)."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from pagedllm.engine.dp_router import (BALANCE, LOAD, PREFIX, BlockHashReport, CachedBlocksMirror, RouteCandidate,
                                       choose_replica, prompt_block_hashes)
from pagedllm.kv.disk_tier import DiskTier
from pagedllm.kv.hash_log import DISK, RAM
from pagedllm.kv.manager import KVCacheManager
from tests.scheduling import new_request

BLOCK_SIZE = 4


class FakeReplica:
    """A replica's KV manager publishing its block hashes, and the router's mirror of them."""

    def __init__(self, num_blocks: int = 64, disk_blocks: int | None = None):
        disk = DiskTier(disk_blocks) if disk_blocks is not None else None
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, disk_tier=disk)
        self.log = self.kv.tiers.publish_block_hashes(max_events=1000)
        self.mirror = CachedBlocksMirror()
        self.num_requests = 0

    def serve(self, token_ids: list[int], salt: str | None = None) -> int:
        """Runs a request's prefill and finishes it (its full blocks stay cached); returns its prefix hit tokens."""
        self.num_requests += 1
        request_id = f"r{self.num_requests}"
        hit = new_request(self.kv, request_id, token_ids, salt)
        self.kv.cache_full_blocks(request_id, token_ids, len(token_ids))
        self.kv.free(request_id)
        return hit

    def report(self) -> None:
        """What EngineReplica.block_hash_report sends, applied as the front applies it."""
        events = self.log.drain()
        self.mirror.apply(BlockHashReport(events) if events is not None
                          else BlockHashReport([], self.kv.tiers.block_hash_snapshot()))

    def cached_blocks_for(self, token_ids: list[int], salt: str | None = None) -> int:
        return self.mirror.num_leading_held(prompt_block_hashes(token_ids, salt, BLOCK_SIZE, self.kv.root_hash))


def candidates(loads: list[int], cached: list[int], routed: list[int] | None = None) -> list[RouteCandidate]:
    routed = routed or [0] * len(loads)
    return [RouteCandidate(i, load, count, blocks) for i, (load, count, blocks) in enumerate(zip(loads, routed, cached))]


def test_the_longest_cached_prefix_wins():
    prompt = list(range(100, 121))                      # 21 tokens: 5 full blocks before the last token
    replicas = [FakeReplica() for _ in range(3)]
    replicas[0].serve(prompt[:9])                       # 2 full blocks of the prompt
    replicas[1].serve(prompt[:14] + [7, 7])             # 3 full blocks, then other tokens
    for replica in replicas:
        replica.report()
    cached = [replica.cached_blocks_for(prompt) for replica in replicas]
    assert cached == [2, 3, 0]
    chosen, reason = choose_replica(candidates([0, 1, 0], cached), balance_abs_threshold=4)
    assert (chosen.index, reason) == (1, PREFIX)


def test_another_salt_gets_no_affinity():
    prompt = list(range(200, 217))
    replica = FakeReplica()
    replica.serve(prompt, salt="tenant-a")
    replica.report()
    assert replica.cached_blocks_for(prompt, "tenant-a") == 4
    assert replica.cached_blocks_for(prompt, "tenant-b") == replica.cached_blocks_for(prompt) == 0
    chosen, reason = choose_replica(candidates([1, 0], [replica.cached_blocks_for(prompt, "tenant-b"), 0]), 4)
    assert (chosen.index, reason) == (1, LOAD)   # the least loaded, as if nothing were cached


def test_a_tie_goes_to_the_least_loaded_then_the_one_given_fewer():
    chosen, reason = choose_replica(candidates([3, 1, 2], [2, 2, 2]), balance_abs_threshold=4)
    assert (chosen.index, reason) == (1, PREFIX)
    chosen, _ = choose_replica(candidates([1, 1], [2, 2], routed=[5, 4]), balance_abs_threshold=4)
    assert chosen.index == 1
    chosen, reason = choose_replica(candidates([2, 0, 1], [0, 0, 0], routed=[0, 3, 0]), balance_abs_threshold=4)
    assert (chosen.index, reason) == (1, LOAD)


def test_a_hot_prefix_spreads_once_the_imbalance_bound_is_hit():
    """Every request carries the same prompt and none finishes; a replica that serves it holds its prefix from
    then on. With a bound of 2, replica 0 takes requests until it has 3 more in flight than replica 1 (3 > 2),
    then replica 1 gets one for balance, and from then both hold the prefix and ties go to the less loaded
    (equal loads: the one given fewer, then the first). Worked by hand:
    loads (0,0) -> 0 P; (1,0) -> 0 P; (2,0) -> 0 P; (3,0): 3 - 0 > 2 -> 1 B; (3,1) tie -> 1 P; (3,2) -> 1 P;
    (3,3), routed (3,3) -> 0 P; (4,3) -> 1 P."""
    holds = [True, False]
    loads, routed, choices = [0, 0], [0, 0], []
    for _ in range(8):
        chosen, reason = choose_replica(candidates(loads, [5 if held else 0 for held in holds], routed), 2)
        choices.append((chosen.index, reason))
        loads[chosen.index] += 1
        routed[chosen.index] += 1
        holds[chosen.index] = True
    assert choices == [(0, PREFIX), (0, PREFIX), (0, PREFIX), (1, BALANCE), (1, PREFIX), (1, PREFIX), (0, PREFIX),
                       (1, PREFIX)]


def test_a_shorter_prefix_within_the_bound_beats_a_longer_one_past_it():
    chosen, reason = choose_replica(candidates([9, 3, 0], [6, 2, 0]), balance_abs_threshold=4)
    assert (chosen.index, reason) == (1, BALANCE)


def test_the_mirror_keeps_a_block_held_on_disk_after_ram_evicts_it():
    """A pool of 3 blocks: a second prompt evicts the first's blocks from RAM, which spills them to the disk tier;
    the router still sees them held (on disk), and the replica's own lookup (RAM, then disk) agrees."""
    replica = FakeReplica(num_blocks=3, disk_blocks=16)
    first, second = list(range(300, 309)), list(range(400, 409))
    replica.serve(first)
    replica.serve(second)
    replica.kv.tiers.take_work()   # what the step does: evicted blocks spill
    replica.report()
    bits = [replica.mirror.held.get(key) for key in prompt_block_hashes(first, None, BLOCK_SIZE, replica.kv.root_hash)]
    assert all(b is not None and b & DISK for b in bits), bits
    assert replica.cached_blocks_for(first) == 2 == replica.cached_blocks_for(second)


def test_an_overflowed_log_is_replaced_by_a_snapshot():
    replica = FakeReplica()
    replica.log.max_events = 2
    replica.report()                                   # the first report is a snapshot, and restarts the log
    prompt = list(range(500, 521))
    replica.serve(prompt)                              # 5 blocks cached: more events than the log keeps
    assert replica.log.drain() is None                 # overflowed: nothing partial is sent
    replica.report()
    assert replica.cached_blocks_for(prompt) == 5
    assert set(replica.mirror.held.values()) == {RAM}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), salts=st.lists(st.sampled_from([None, "a", "b"]), min_size=1, max_size=6))
def test_the_router_counts_exactly_the_blocks_the_replica_would_hit(seed, salts):
    """Prompts that share random prefixes, served under random salts on a small pool (so some blocks are evicted
    between reports): for every new prompt, the blocks the router counts held equal the replica's own prefix hit."""
    rng = random.Random(seed)
    stem = [rng.randrange(50) for _ in range(24)]
    replica = FakeReplica(num_blocks=12)
    for salt in salts:
        prompt = stem[:rng.randrange(1, 24)] + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
        replica.report()
        expected = len(replica.kv.get_computed_blocks("probe", prompt, salt))
        replica.kv.free("probe")
        assert replica.cached_blocks_for(prompt, salt) == expected
        replica.serve(prompt, salt)
