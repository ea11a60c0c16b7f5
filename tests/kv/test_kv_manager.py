"""Block pool and block tables: hand-computed counts and property-based bookkeeping checks."""
import hashlib
import math
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.kv import block_pool as block_pool_module
from pagedllm.kv.block_pool import BlockPool, hash_block
from pagedllm.kv.disk_tier import DiskTier, key_digest
from pagedllm.kv.manager import GROWTH_ROOM_BLOCKS, RELEASED, KVCacheManager
from pagedllm.kv.swap import SwapSpace
from tests.scheduling import new_request


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("length", [1, 7, 8, 9, 16, 17, 100, 256])
def test_table_holds_ceil_length_over_block_size(block_size, length):
    manager = KVCacheManager(num_blocks=64, block_size=block_size)
    assert manager.allocate_slots("r", length, 0)
    assert len(manager.get_block_table("r")) == math.ceil(length / block_size)
    assert manager.pool.num_free_blocks == 64 - math.ceil(length / block_size)


def test_grows_one_block_only_when_the_last_is_full():
    manager = KVCacheManager(num_blocks=8, block_size=16)
    sizes = []
    for length in range(1, 50):
        assert manager.allocate_slots("r", length, length - 1)
        sizes.append(len(manager.get_block_table("r")))
    assert sizes == [1] * 16 + [2] * 16 + [3] * 16 + [4]


def test_refuses_without_side_effects_when_pool_is_short():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    assert manager.allocate_slots("a", 48, 0)
    assert not manager.allocate_slots("b", 32, 0)
    assert "b" not in manager.block_tables
    assert manager.pool.num_free_blocks == 1


def test_free_returns_every_block():
    manager = KVCacheManager(num_blocks=10, block_size=8, enable_prefix_caching=False)
    manager.allocate_slots("a", 30, 0)
    manager.allocate_slots("b", 17, 0)
    manager.free("a")
    manager.free("b")
    assert manager.pool.num_free_blocks == 10
    assert sorted(b.block_id for b in manager.pool.free_block_queue) == list(range(10))
    assert manager.usage().num_used_blocks == 0


def test_utilization_counts_stored_tokens_over_allocated_slots():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    manager.allocate_slots("a", 20, 0)   # 2 blocks, 20 tokens
    manager.allocate_slots("b", 16, 0)   # 1 block, 16 tokens
    usage = manager.usage()
    assert usage.num_used_blocks == 3
    assert usage.utilization == pytest.approx(36 / 48)
    assert usage.usage == pytest.approx(0.3)


def test_fork_shares_every_block_and_copies_only_the_written_partial_one():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    manager.allocate_slots("parent", 10, 0)           # blocks [a, b, c], c holds 2 of 4
    manager.fork("parent", "child")
    parent_table = manager.get_block_table("parent")
    assert manager.get_block_table("child") == parent_table
    assert manager.usage().num_shared_blocks == 3 and manager.pool.num_used_blocks == 3
    # The child writes token 11 (position 10) into the shared, partly filled block c.
    assert manager.allocate_slots("child", 11, 10)
    child_table = manager.get_block_table("child")
    assert child_table[:2] == parent_table[:2] and child_table[2] != parent_table[2]
    assert manager.take_block_copies() == [(parent_table[2], child_table[2])]
    # c is the parent's alone now: writing into it needs no copy.
    assert manager.allocate_slots("parent", 11, 10)
    assert manager.take_block_copies() == []
    assert manager.get_block_table("parent") == parent_table
    manager.free("parent")
    manager.free("child")
    assert manager.pool.num_free_blocks == 10


def test_fork_on_a_block_boundary_copies_nothing():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    manager.allocate_slots("parent", 8, 0)
    manager.fork("parent", "child")
    assert manager.allocate_slots("child", 9, 8)
    assert manager.take_block_copies() == []
    assert manager.get_block_table("child")[:2] == manager.get_block_table("parent")


def test_prefix_hit_reuses_full_blocks_and_always_leaves_a_token_to_compute():
    manager = KVCacheManager(num_blocks=20, block_size=4)
    prompt = list(range(100, 110))                    # 2 full blocks + 2 tokens
    assert new_request(manager, "a", prompt) == 0
    manager.cache_full_blocks("a", prompt, len(prompt))
    first_blocks = manager.get_block_table("a")[:2]
    manager.free("a")
    assert manager.usage().num_cached_idle_blocks == 2
    # Same first 9 tokens, then different: both full blocks are reused, the very same ones.
    assert new_request(manager, "b", prompt[:9] + [7, 7, 7]) == 8
    assert manager.get_block_table("b")[:2] == first_blocks
    # An 8-token prompt whose 2 blocks are both cached: its last token must still be
    # computed, so only the first block (4 tokens) is reused.
    assert new_request(manager, "c", prompt[:8]) == 4
    # Lookups: 10 tokens / 0 hit, 12 / 8, 8 / 4.
    assert manager.usage().prefix_cache_hit_rate == pytest.approx(12 / 30)


def test_hash_chains_the_parent():
    tokens = (1, 2, 3, 4)
    assert hash_block(None, tokens) != hash_block(hash_block(None, (9, 9, 9, 9)), tokens)
    assert hash_block(None, tokens) != hash_block(None, tokens, extra_key="lora-1")


def test_hash_is_sha256_of_an_unambiguous_encoding():
    """A parent digest, the token count and ids, then the extra key: inputs that a naive concatenation
    would run together hash apart, and the digest is sha256 of exactly that encoding."""
    parent = hash_block(None, (7,))
    expected = hashlib.sha256(parent + (2).to_bytes(4, "little") + (1).to_bytes(4, "little")
                              + (2).to_bytes(4, "little") + b"\x01salt").digest()
    assert hash_block(parent, (1, 2), "salt") == expected
    assert len({hash_block(parent, (1, 2)), hash_block(parent, (1, 2), ""), hash_block(parent, (1,), "2"),
                hash_block(parent, (1, 2, 0)), hash_block(parent, (2, 1)), hash_block(None, (1, 2))}) == 6


def test_hash_root_is_random_per_process():
    """No one can precompute a first block's hash: the chain's root differs in every process."""
    code = "from pagedllm.kv.block_pool import hash_block; print(hash_block(None, (1, 2, 3)).hex())"
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
               for _ in range(2)}
    assert len(digests) == 2 and hash_block(None, (1, 2, 3)).hex() + "\n" not in digests


def test_a_hash_collision_never_shares_a_block(monkeypatch):
    """With every block forced to the same hash, a prompt of other tokens finds nothing: a hit needs the
    block's own tokens (and its parent's hash, and the salt) to match, not only the hash."""
    monkeypatch.setattr(block_pool_module, "hash_block", lambda *key, root_hash: b"\0" * 32)
    manager = KVCacheManager(num_blocks=20, block_size=4)
    victim = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    new_request(manager, "victim", victim)
    manager.cache_full_blocks("victim", victim, len(victim))
    assert new_request(manager, "attacker", [20, 21, 22, 23, 24, 25, 26, 27, 28]) == 0
    assert new_request(manager, "salted", victim, cache_salt="other") == 0
    assert new_request(manager, "same", victim) == 4     # the patch left real hits possible
    assert manager.pool.blocks[manager.get_block_table("same")[0]].ref_count == 2


def test_salts_separate_cached_blocks_and_equal_salts_share():
    manager = KVCacheManager(num_blocks=32, block_size=4)
    prompt = list(range(100, 113))                     # 3 full blocks + 1 token
    assert new_request(manager, "alice-1", prompt, "alice") == 0
    manager.cache_full_blocks("alice-1", prompt, len(prompt))
    assert new_request(manager, "bob", prompt, "bob") == 0
    assert new_request(manager, "unsalted", prompt) == 0
    assert new_request(manager, "alice-2", prompt, "alice") == 12
    alice_blocks = set(manager.get_block_table("alice-1"))
    assert alice_blocks.isdisjoint(manager.get_block_table("bob"))
    assert alice_blocks.isdisjoint(manager.get_block_table("unsalted"))
    assert set(manager.get_block_table("alice-2")[:3]) <= alice_blocks
    assert manager.usage().num_shared_blocks == 3


def test_a_fork_keeps_its_parents_salt():
    """A child's later blocks chain from the parent's salted ones; a block the child fills is found by
    the same salt only."""
    manager = KVCacheManager(num_blocks=32, block_size=4)
    prompt = [1, 2, 3]
    new_request(manager, "parent", prompt, "tenant")
    manager.fork("parent", "child")
    tokens = prompt + [4, 5, 6, 7, 8]
    assert manager.allocate_slots("child", len(tokens), len(prompt))
    manager.cache_full_blocks("child", tokens, len(tokens))
    assert new_request(manager, "other-tenant", tokens + [9], "intruder") == 0
    assert new_request(manager, "same-tenant", tokens + [9], "tenant") == 8


def test_idle_cached_blocks_are_evicted_least_recently_released_first():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    for name, tokens in (("old", [1, 2, 3]), ("new", [4, 5, 6])):
        new_request(manager, name, tokens)
        manager.cache_full_blocks(name, tokens, 3)
        manager.free(name)
    assert manager.usage().num_cached_idle_blocks == 2   # [1, 2] and [4, 5]
    # Three of the four free blocks are needed: the partial blocks go first, then [1, 2],
    # released before [4, 5].
    assert manager.allocate_slots("x", 6, 0)
    assert manager.get_computed_blocks("q1", [1, 2, 3]) == []
    (hit,) = manager.get_computed_blocks("q2", [4, 5, 9])
    assert hit.block_hash is not None and hit.ref_count == 0
    assert manager.usage().num_cached_idle_blocks == 1


def test_released_blocks_holding_nothing_are_written_again_before_unwritten_ones():
    """Pool of 6 blocks of 2. A request on blocks 0-2 finishes with [1, 2] cached: the partial blocks it
    released (1, 2; the manager releases a table last block first) go to the front of the free queue, its
    cached block (0) to the back. The next request takes 1 and 2, then 3, never written; the cached block
    is taken last."""
    manager = KVCacheManager(num_blocks=6, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    new_request(manager, "first", tokens)
    assert manager.get_block_table("first") == [0, 1, 2]
    manager.cache_full_blocks("first", tokens[:2], 2)   # only [1, 2] counts as computed and cached
    manager.free("first")
    assert [block.block_id for block in manager.pool.free_block_queue] == [1, 2, 3, 4, 5, 0]
    assert manager.allocate_slots("second", 6, 0)
    assert manager.get_block_table("second") == [1, 2, 3]
    assert manager.usage().num_cached_idle_blocks == 1


def test_a_growing_table_takes_the_blocks_right_after_its_own():
    """Pool of 40 blocks of 2, room of 16 (GROWTH_ROOM_BLOCKS). "a" takes 0-1 from the front; the 16 free blocks
    after them (2-17) go to the end of the empty free blocks, so "b" takes 18-19. Growing by two blocks, "a" takes
    2 and 3, side by side with its own, and "b" 20, then "a" 4 although 22 is at the front."""
    manager = KVCacheManager(num_blocks=40, block_size=2, enable_prefix_caching=False)
    assert GROWTH_ROOM_BLOCKS == 16
    new_request(manager, "a", [1, 2, 3])
    new_request(manager, "b", [4, 5, 6])
    assert manager.get_block_table("a") == [0, 1] and manager.get_block_table("b") == [18, 19]
    assert [block.block_id for block in manager.pool.free_block_queue][:3] == [36, 37, 38]
    assert manager.allocate_slots("a", 8, 3)
    assert manager.allocate_slots("b", 5, 3)
    assert manager.allocate_slots("a", 10, 8)
    assert manager.get_block_table("a") == [0, 1, 2, 3, 4] and manager.get_block_table("b") == [18, 19, 20]


def test_the_room_kept_for_a_table_goes_to_others_when_nothing_else_is_free():
    """Pool of 8 blocks of 2: "a" takes 0-1 and its room holds 2-7, every other free block. "b" asking for all 6
    gets them (room is a preference, never a reservation), and the pool is full."""
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    new_request(manager, "a", [1, 2, 3])
    assert new_request(manager, "b", list(range(12))) == 0
    assert manager.get_block_table("b") == [2, 3, 4, 5, 6, 7] and manager.pool.num_free_blocks == 0


def test_a_growing_table_never_takes_a_block_holding_a_cached_prefix():
    """Pool of 6 blocks of 2, prefix caching on. "x" computes [7, 8 | 9, 10] on blocks 0-1, both cached, and is
    freed: they wait at the back. "y" = [7, 8, 20] finds [7, 8] on block 0 and needs one block more: block 1, right
    after 0, is free but holds x's second block, so y takes the front's block 2 and x's prefix stays whole."""
    manager = KVCacheManager(num_blocks=6, block_size=2)
    x = [7, 8, 9, 10]
    new_request(manager, "x", x)
    manager.cache_full_blocks("x", x, 4)
    manager.free("x")
    assert new_request(manager, "y", [7, 8, 20]) == 2
    assert manager.get_block_table("y") == [0, 2]
    assert manager.usage().num_cached_idle_blocks == 1


def test_sliding_window_releases_blocks_no_coming_token_sees():
    """Window 8, blocks of 4: a token at position p sees keys p - 7 .. p. A 10-token prompt, then one token
    per step: at the step computing position c the blocks wholly before c - 7 go back (hand-computed)."""
    manager = KVCacheManager(num_blocks=8, block_size=4, sliding_window=8)
    tokens = list(range(10))
    assert new_request(manager, "a", tokens) == 0
    manager.cache_full_blocks("a", tokens, 10)
    released_per_step, held = [], []
    for position in range(10, 21):
        before = manager.num_released_blocks("a")
        assert manager.allocate_slots("a", position + 1, position)
        tokens.append(position)
        manager.cache_full_blocks("a", tokens, position + 1)
        released_per_step.append(manager.num_released_blocks("a") - before)
        held.append(manager.pool.num_used_blocks)
    #                     c = 10 11 12 13 14 15 16 17 18 19 20
    assert released_per_step == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    assert held == [3, 2, 3, 3, 3, 2, 3, 3, 3, 2, 3]
    assert manager.get_block_table("a")[:3] == [-1, -1, -1]
    # Released full blocks stay in the prefix cache: all three, idle.
    assert manager.usage().num_cached_idle_blocks == 3
    manager.fork("a", "b")
    assert manager.num_released_blocks("b") == 3 and manager.pool.num_used_blocks == 3
    manager.free("a")
    manager.free("b")
    assert manager.pool.num_free_blocks == 8


def test_pool_rejects_double_free():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks)


class KVManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / speculate (with rollback or abort) / fork / free / cache-hit / evict / pin /
    expire sequences keep the books right."""

    BLOCK_SIZE = 4
    SLIDING_WINDOW = None
    MAX_PINNED_FRACTION = 0.5

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.manager = KVCacheManager(num_blocks=16, block_size=self.BLOCK_SIZE, sliding_window=self.SLIDING_WINDOW,
                                      max_pinned_fraction=self.MAX_PINNED_FRACTION, clock=lambda: self.now,
                                      **self.manager_options())
        self.tokens: dict[str, list[int]] = {}
        self.computed_at_growth: dict[str, int] = {}   # num_computed_tokens of the request's last growth
        self.counter = 0

    def manager_options(self) -> dict:
        return {}

    def held(self, name):
        """(index, block) of the table entries the request holds (not released outside its window)."""
        table = self.manager.block_tables[name]
        released = self.manager.num_released_blocks(name)
        return list(enumerate(table))[released:]

    def _name(self):
        self.counter += 1
        return f"r{self.counter}"

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def add(self, prefix, tail):
        """Prompts drawn from a tiny alphabet with shared heads, so prefix hits are common."""
        name, tokens = self._name(), prefix + tail
        if new_request(self.manager, name, tokens) is not None:
            self.manager.cache_full_blocks(name, tokens, len(tokens))
            self.tokens[name] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        name = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[name]
        self.computed_at_growth[name] = len(tokens)
        if self.manager.allocate_slots(name, len(tokens) + 1, len(tokens)):
            tokens.append(token)
            self.manager.cache_full_blocks(name, tokens, len(tokens))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_spec=st.integers(1, 6), tokens=st.lists(st.integers(0, 3), min_size=7, max_size=7),
          abort=st.booleans())
    def speculate(self, data, num_spec, tokens, abort):
        """A speculative step: slots for the decode token and num_spec proposals, then the decode token and
        the accepted proposals kept and the rest rolled back; or the request aborted mid-speculation."""
        name = data.draw(st.sampled_from(sorted(self.tokens)))
        held = self.tokens[name]
        self.computed_at_growth[name] = len(held)
        if not self.manager.allocate_slots(name, len(held) + 1 + num_spec, len(held)):
            return
        assert len(self.manager.block_tables[name]) == math.ceil((len(held) + 1 + num_spec) / self.BLOCK_SIZE)
        if abort:
            self.manager.free(name)
            del self.tokens[name], self.computed_at_growth[name]
            return
        num_accepted = data.draw(st.integers(0, num_spec))
        free_before = self.manager.pool.num_free_blocks
        blocks_before = len(self.manager.block_tables[name])
        held.extend(tokens[:1 + num_accepted])
        self.manager.rollback(name, len(held))
        kept = math.ceil(len(held) / self.BLOCK_SIZE)
        # Blocks of rejected tokens only were taken for this step alone: every one is free again at once.
        assert self.manager.pool.num_free_blocks == free_before + blocks_before - kept
        self.manager.cache_full_blocks(name, held, len(held))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._name()
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        if parent in self.computed_at_growth:
            self.computed_at_growth[child] = self.computed_at_growth[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        name = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(name)
        del self.tokens[name]
        self.computed_at_growth.pop(name, None)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_tokens=st.integers(0, 24), ttl_s=st.sampled_from([1.0, 5.0, 60.0]))
    def pin(self, data, num_tokens, ttl_s):
        """A request pins a prefix of its computed tokens: whole blocks, at most as many as are full."""
        name = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[name]
        num_tokens = min(num_tokens, len(tokens))
        pinned = self.manager.pin_prefix(name, tokens, num_tokens, ttl_s)
        assert pinned % self.BLOCK_SIZE == 0 and 0 <= pinned <= num_tokens

    @rule(seconds=st.sampled_from([0.5, 1.0, 4.0, 100.0]))
    def advance_clock(self, seconds):
        self.now += seconds
        self.manager.expire_pins()

    @invariant()
    def pins_hold_cached_blocks_within_the_bound(self):
        pool = self.manager.pool
        covering = Counter(block.block_id for pin in pool.pins.values() for block in pin.blocks)
        for block in pool.blocks:
            assert block.pin_count == covering[block.block_id], "pin count differs from the pins covering the block"
        for pin in pool.pins.values():
            assert pin.deadline > self.now, "an expired pin outlived a clock move"
            assert all(pool.cached_blocks.get(block.block_hash) is block for block in pin.blocks)
        assert pool.num_pinned_blocks == len(covering) <= self.manager.max_pinned_blocks

    @invariant()
    def books_balance(self):
        manager, pool = self.manager, self.manager.pool
        manager.take_block_copies()
        holders = Counter(block.block_id for name in manager.block_tables for _, block in self.held(name))
        for name, table in manager.block_tables.items():
            released = manager.num_released_blocks(name)
            assert manager.get_block_table(name) == [RELEASED] * released + [block.block_id
                                                                              for block in table[released:]]
        free_ids = {block.block_id for block in pool.free_block_queue}
        pinned_ids = {block.block_id for block in pool.blocks if block.pin_count}
        assert all(block.ref_count >= 0 for block in pool.blocks)
        for block in pool.blocks:
            assert block.ref_count == holders[block.block_id], "ref count differs from table entries"
        assert free_ids.isdisjoint(holders), "a block is both free and in use"
        assert free_ids.isdisjoint(pinned_ids), "a pinned block is evictable"
        assert len(free_ids) + len(pinned_ids | set(holders)) == pool.num_blocks
        usage = manager.usage()
        assert usage.num_free_blocks + usage.num_used_blocks == usage.num_blocks
        assert usage.num_cached_idle_blocks <= usage.num_free_blocks
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
        for name, tokens in self.tokens.items():
            assert len(manager.block_tables[name]) == math.ceil(len(tokens) / self.BLOCK_SIZE)

    @invariant()
    def shared_blocks_hold_the_same_tokens(self):
        """Requests pointing at one block agree on every token in it (no missed copy-on-write)."""
        size = self.BLOCK_SIZE
        seen: dict[int, tuple[int, ...]] = {}
        for name in self.manager.block_tables:
            tokens = self.tokens[name]
            for index, block in self.held(name):
                content = tuple(tokens[index * size:(index + 1) * size])
                other = seen.setdefault(block.block_id, content)
                shorter = min(len(other), len(content))
                assert other[:shorter] == content[:shorter]

    def teardown(self):
        for name in list(self.tokens):
            self.manager.free(name)
        pool = self.manager.pool
        assert pool.num_free_blocks == pool.num_blocks - pool.num_pinned_blocks
        self.now = math.inf
        assert self.manager.usage().num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks


TestKVManagerMachine = KVManagerMachine.TestCase
TestKVManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedKVManagerMachine(KVManagerMachine):
    """The same with a sliding window of 6 tokens (not a whole number of blocks): as requests grow, their
    leading blocks leave the window and are released, through speculation, rollback, forks and prefix hits."""

    SLIDING_WINDOW = 6

    @invariant()
    def released_blocks_are_exactly_those_no_coming_token_sees(self):
        for name, tokens in self.tokens.items():
            # A request releases when it grows: every whole block before the window of its first new token,
            # which sees keys from num_computed - 6 + 1 on (a new request, whose table a prefix hit may
            # have started, releases at its next growth).
            first_seen = max(0, self.computed_at_growth.get(name, 0) - self.SLIDING_WINDOW + 1)
            assert self.manager.num_released_blocks(name) == first_seen // self.BLOCK_SIZE
            assert first_seen <= len(tokens)


TestWindowedKVManagerMachine = WindowedKVManagerMachine.TestCase
TestWindowedKVManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class DiskKVManagerMachine(KVManagerMachine):
    """The same over a disk tier of 6 blocks: evicted cached blocks spill, prefixes come back from disk (some
    loads failing), and the disk's LRU evicts; the disk's index always equals the files a model of the
    workers would hold (spills added, deletes removed), and every RAM block is accounted for as above."""

    DISK_BLOCKS = 6

    def manager_options(self) -> dict:
        self.files: dict[bytes, bytes] = {}   # what the workers' directory holds: hash -> key digest
        self.keys: dict[bytes, bytes] = {}    # key digest of every block ever cached
        return {"disk_tier": DiskTier(self.DISK_BLOCKS)}

    def _apply(self, work) -> None:
        """The workers' side of a step's disk work: every spilled block is an evicted cached one."""
        for block_id, block_hash, digest in work.spills:
            assert self.manager.pool.blocks[block_id].block_hash != block_hash, "a spilled block is still cached"
            assert block_hash not in self.files
            self.files[block_hash] = digest
        for block_hash in work.deletes:
            del self.files[block_hash]

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=14), fails=st.lists(st.booleans(), max_size=8))
    def add_via_disk(self, prefix, tail, fails):
        """A new request whose prefix may continue on disk: those blocks are loaded (fails[i]: load i could not
        be read), then it is admitted with them as prefix hits, or refused and freed."""
        manager, name, tokens = self.manager, self._name(), prefix + tail
        hits = manager.get_computed_blocks(name, tokens)
        if manager.load_from_disk(name, tokens, hits):
            work = manager.tiers.take_work()
            for _, block_hash, digest in work.loads:   # found in the index before this step's spills
                assert self.files[block_hash] == digest
            self._apply(work)
            failed = [load for load, fail in zip(work.loads, fails) if fail]
            manager.complete_disk_loads([block_id for block_id, _, _ in failed])
            leading = next((index for index, load in enumerate(work.loads) if load in failed), len(work.loads))
            before, hits = len(hits), manager.get_computed_blocks(name, tokens)
            assert len(hits) == before + leading
            for _, block_hash, _ in failed:
                assert block_hash not in manager.disk
                self.files.pop(block_hash, None)
        if manager.allocate_slots(name, len(tokens), len(hits) * self.BLOCK_SIZE, hits):
            manager.cache_full_blocks(name, tokens, len(tokens))
            self.tokens[name] = tokens
        else:
            manager.free(name)

    @invariant()
    def disk_books_balance(self):
        """Both tiers: the index is exactly the files, within the quota, and lists no block twice."""
        self._apply(self.manager.tiers.take_work())
        disk = self.manager.disk
        assert dict(disk.entries) == self.files
        assert len(disk) <= self.DISK_BLOCKS
        counters = disk.counters
        assert counters.spills - counters.evictions - counters.read_failures <= len(disk) <= (
            counters.spills - counters.evictions)


TestDiskKVManagerMachine = DiskKVManagerMachine.TestCase
TestDiskKVManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class SwapMoves:
    """Swap-out and swap-in moves (some copies failing to come back), with a model of the workers' swap space:
    each copy remembers the request and table entry it was made from, and must land back in that entry.
    Every block is accounted for: in RAM (the pool's books, as above), in the swap space (one copy per
    reserved block, each of a swapped-out request), and on disk (files and swapped blocks within the quota)."""

    SWAP_BLOCKS = 6

    def swap_space(self, disk: DiskTier | None = None) -> SwapSpace:
        self.copies: dict[int, tuple[str, int]] = {}   # swap key -> (request, table entry) it was copied from
        self.swapped: dict[str, list[int]] = {}         # swapped-out request -> its tokens
        self.growth_when_swapped: dict[str, int | None] = {}
        return SwapSpace(self.SWAP_BLOCKS, disk)

    def _take_work(self):
        work = self.manager.tiers.take_work()
        self._apply(work)
        for key in work.swap_drops:
            del self.copies[key]
        return work

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        manager, name = self.manager, data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[name]
        entry_of = {block.block_id: index for index, block in self.held(name)}
        to_copy = manager.num_blocks_to_swap(name, len(tokens))
        room = manager.swap.capacity_blocks - manager.swap.num_blocks
        if not manager.swap_out(name, len(tokens)):
            assert to_copy > room
            return
        work = self._take_work()
        assert len(work.swap_outs) == to_copy <= room
        for block_id, key in work.swap_outs:
            self.copies[key] = (name, entry_of[block_id])
        assert name not in manager.block_tables and manager.tiers.is_swapped(name)
        self.swapped[name] = self.tokens.pop(name)
        self.growth_when_swapped[name] = self.computed_at_growth.pop(name, None)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), fails=st.lists(st.booleans(), max_size=8))
    def swap_in(self, data, fails):
        """Copies come back into fresh blocks (fails[i]: copy i could not be read); the request then holds its
        table up to the first failed entry, and is admitted with those tokens computed."""
        manager, name = self.manager, data.draw(st.sampled_from(sorted(self.swapped)))
        tokens = self.swapped[name]
        if not manager.tiers.swap_in(name, len(tokens)):
            assert manager.tiers.is_swapped(name) and not manager.tiers.is_loading(name)
            return
        assert manager.tiers.is_loading(name)
        work = self._take_work()
        landing = {}
        for block_id, key in work.swap_ins:
            landing[block_id] = self.copies.pop(key)
            assert landing[block_id][0] == name
        failed = [block_id for (block_id, _), fail in zip(work.swap_ins, fails) if fail]
        manager.complete_disk_loads(failed)
        del self.swapped[name]
        restored = manager.tiers.restored_tokens(name)
        if restored is None:   # a copy of the first entry failed (or a shared block is gone): it recomputes
            assert name not in manager.block_tables
            return
        table = manager.block_tables[name]
        for index, block in self.held(name):
            if block.block_id in landing:
                assert landing[block.block_id] == (name, index), "a copy came back into another entry"
                assert block.block_id not in failed
        assert restored == min(len(tokens), len(table) * self.BLOCK_SIZE)
        if not failed:
            assert restored == len(tokens) or len(table) < math.ceil(len(tokens) / self.BLOCK_SIZE)
        manager.tiers.take_restored(name)
        self.tokens[name] = tokens[:restored]
        growth = self.growth_when_swapped.pop(name)
        if growth is not None:   # released entries stay released: as at its last growth
            self.computed_at_growth[name] = growth

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def free_swapped(self, data):
        """A swapped-out request ends (aborted): its copies are dropped, its room given back."""
        name = data.draw(st.sampled_from(sorted(self.swapped)))
        keys = {key for key, (owner, _) in self.copies.items() if owner == name}
        self.manager.free(name)
        work = self._take_work()
        assert set(work.swap_drops) == keys
        del self.swapped[name]

    @invariant()
    def swap_books_balance(self):
        self._take_work()
        swap = self.manager.swap
        assert len(self.copies) == swap.num_blocks <= swap.capacity_blocks
        assert {owner for owner, _ in self.copies.values()} <= set(self.swapped)
        assert all(self.manager.tiers.is_swapped(name) for name in self.swapped)
        if swap.disk is not None:
            assert len(swap.disk) + swap.num_blocks <= swap.disk.capacity_blocks

    def teardown(self):
        for name in list(self.swapped):
            self.manager.free(name)
            self.swapped.pop(name)
        self._take_work()
        assert not self.copies and self.manager.swap.num_blocks == 0
        super().teardown()


class RamSwapMoves(SwapMoves):
    """Swapping to RAM staging: the manager has no disk tier, so a step moves swapped blocks only."""

    def manager_options(self) -> dict:
        return {"swap_space": self.swap_space()}

    def _apply(self, work) -> None:
        assert not (work.spills or work.loads or work.deletes)


class SwapKVManagerMachine(RamSwapMoves, KVManagerMachine):
    """Swapping over the plain manager."""


TestSwapKVManagerMachine = SwapKVManagerMachine.TestCase
TestSwapKVManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedSwapKVManagerMachine(RamSwapMoves, WindowedKVManagerMachine):
    """Swapping with a sliding window: released entries stay released through a swap."""


TestWindowedSwapKVManagerMachine = WindowedSwapKVManagerMachine.TestCase
TestWindowedSwapKVManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class DiskSwapKVManagerMachine(SwapMoves, DiskKVManagerMachine):
    """Swapping into the disk tier's quota, beside spills, disk hits and evictions."""

    def manager_options(self) -> dict:
        options = super().manager_options()
        return options | {"swap_space": self.swap_space(options["disk_tier"])}


TestDiskSwapKVManagerMachine = DiskSwapKVManagerMachine.TestCase
TestDiskSwapKVManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
