"""Block pool and block tables: hand-computed counts and property-based bookkeeping checks."""
import math

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, precondition

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.manager import KVCacheManager


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("length", [1, 7, 8, 9, 16, 17, 100, 256])
def test_table_holds_ceil_length_over_block_size(block_size, length):
    manager = KVCacheManager(num_blocks=64, block_size=block_size)
    assert manager.allocate_slots("r", length)
    assert len(manager.get_block_table("r")) == math.ceil(length / block_size)
    assert manager.pool.num_free_blocks == 64 - math.ceil(length / block_size)


def test_grows_one_block_only_when_the_last_is_full():
    manager = KVCacheManager(num_blocks=8, block_size=16)
    sizes = []
    for length in range(1, 50):
        assert manager.allocate_slots("r", length)
        sizes.append(len(manager.get_block_table("r")))
    assert sizes == [1] * 16 + [2] * 16 + [3] * 16 + [4]


def test_refuses_without_side_effects_when_pool_is_short():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    assert manager.allocate_slots("a", 48)
    assert not manager.allocate_slots("b", 32)
    assert "b" not in manager.block_tables
    assert manager.pool.num_free_blocks == 1


def test_free_returns_every_block():
    manager = KVCacheManager(num_blocks=10, block_size=8)
    manager.allocate_slots("a", 30)
    manager.allocate_slots("b", 17)
    manager.free("a")
    manager.free("b")
    assert manager.pool.num_free_blocks == 10
    assert sorted(manager.pool.free_block_queue) == list(range(10))
    assert manager.usage().num_used_blocks == 0


def test_utilization_counts_stored_tokens_over_allocated_slots():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    manager.allocate_slots("a", 20)   # 2 blocks, 20 tokens
    manager.allocate_slots("b", 16)   # 1 block, 16 tokens
    usage = manager.usage()
    assert usage.num_used_blocks == 3
    assert usage.utilization == pytest.approx(36 / 48)
    assert usage.usage == pytest.approx(0.3)


def test_pool_rejects_double_free():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks)


class KVManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / free sequences never leak or double-book a block."""

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(num_blocks=24, block_size=8)
        self.lengths: dict[str, int] = {}
        self.counter = 0

    @rule(length=st.integers(1, 100))
    def add(self, length):
        name = f"r{self.counter}"
        self.counter += 1
        if self.manager.allocate_slots(name, length):
            self.lengths[name] = length

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), extra=st.integers(1, 20))
    def grow(self, data, extra):
        name = data.draw(st.sampled_from(sorted(self.lengths)))
        if self.manager.allocate_slots(name, self.lengths[name] + extra):
            self.lengths[name] += extra

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data):
        name = data.draw(st.sampled_from(sorted(self.lengths)))
        self.manager.free(name)
        del self.lengths[name]

    @invariant()
    def books_balance(self):
        pool = self.manager.pool
        tables = self.manager.block_tables
        used = [b for table in tables.values() for b in table]
        assert len(used) == len(set(used)), "a block is in two tables"
        assert set(used).isdisjoint(pool.free_block_queue), "a block is both free and in use"
        assert len(used) + pool.num_free_blocks == pool.num_blocks
        assert all(count >= 0 for count in pool.ref_counts)
        for name, length in self.lengths.items():
            assert len(tables[name]) == math.ceil(length / 8)

    def teardown(self):
        for name in list(self.lengths):
            self.manager.free(name)
        assert self.manager.pool.num_free_blocks == self.manager.pool.num_blocks


TestKVManagerMachine = KVManagerMachine.TestCase
TestKVManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
