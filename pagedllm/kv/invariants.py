"""Invariants of the KV bookkeeping, checked by the simulations and tests: each check returns the problems it
finds (empty when the property holds) and never raises."""
from __future__ import annotations

from collections import Counter

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.manager import KVCacheManager


def check_free_queue(pool: BlockPool) -> list[str]:
    """Walks the free queue forwards through next_free and back through prev_free: both walks must end
    at the queue's sentinels and see the same blocks in reverse order, each pool block at most once,
    num_free_blocks of them, exactly the blocks with ref count 0, and every block holding a cached prefix behind
    every block holding nothing."""
    problems = []
    members = {id(block) for block in pool.blocks}
    limit = pool.num_blocks + 1   # a cycle stops the walk here and shows as a duplicate
    first = next(iter(pool.free_block_queue), None)
    forward, node = [], first
    while node is not None and id(node) in members and len(forward) < limit:
        forward.append(node)
        node = node.next_free
    if forward and (node is None or id(node) in members or node.prev_free is not forward[-1]):
        problems.append("free queue: the forward walk does not end at the tail sentinel")
    backward, node = [], forward[-1] if forward else None
    while node is not None and id(node) in members and len(backward) < limit:
        backward.append(node)
        node = node.prev_free
    if forward and (node is None or id(node) in members or node.next_free is not first):
        problems.append("free queue: the backward walk does not end at the head sentinel")
    if backward[::-1] != forward:
        problems.append(f"free queue: the forward and backward walks differ ({len(forward)} / "
                        f"{len(backward)} blocks)")
    ids = [block.block_id for block in forward]
    linked = set(ids)
    if len(linked) != len(ids):
        problems.append(f"free queue: {len(ids) - len(linked)} blocks linked more than once")
    if len(forward) != pool.num_free_blocks:
        problems.append(f"free queue: {len(forward)} blocks linked but num_free_blocks is {pool.num_free_blocks}")
    cached = [block.block_hash is not None for block in forward]
    if True in cached and not all(cached[cached.index(True):]):
        problems.append("free queue: a block holding nothing sits behind one holding a cached prefix")
    free = {block.block_id for block in pool.blocks if block.is_free}
    if linked != free:
        problems.append(f"free queue: {len(linked - free)} held blocks in it, {len(free - linked)} free "
                        "blocks missing from it")
    return problems


def check_cached_blocks(pool: BlockPool) -> list[str]:
    """cached_blocks maps a hash to a pool block whose own block_hash is that hash, and every block
    with a hash is found under it: a stale entry would hand a request some other block's KV."""
    problems = []
    wrong = sum(1 for block_hash, block in pool.cached_blocks.items()
                if block.block_hash != block_hash or not 0 <= block.block_id < pool.num_blocks
                or pool.blocks[block.block_id] is not block)
    if wrong:
        problems.append(f"cached_blocks: {wrong} entries point at blocks whose block_hash differs")
    unlisted = sum(1 for block in pool.blocks
                   if block.block_hash is not None and pool.cached_blocks.get(block.block_hash) is not block)
    if unlisted:
        problems.append(f"cached_blocks: {unlisted} blocks carry a hash that does not map to them")
    return problems


def check_ref_counts(kv: KVCacheManager) -> list[str]:
    """Each block's ref count equals the number of block-table entries holding it."""
    held = Counter(block.block_id for table in kv.block_tables.values() for block in table)
    wrong = [block for block in kv.pool.blocks if block.ref_count != held.get(block.block_id, 0)]
    if not wrong:
        return []
    sample = ", ".join(f"block {b.block_id}: ref {b.ref_count}, in {held.get(b.block_id, 0)} tables"
                       for b in wrong[:3])
    return [f"ref counts: {len(wrong)} blocks disagree with the block tables ({sample})"]


def check_kv_consistent(kv: KVCacheManager) -> list[str]:
    """What must hold at any point between steps: ref counts match the block tables, the free queue is
    well formed, and cached_blocks is exact."""
    return check_ref_counts(kv) + check_free_queue(kv.pool) + check_cached_blocks(kv.pool)


def per_request_state(owner) -> list[str]:
    """The dict, list and set attributes of owner that are not empty, as 'name (length)', whatever they are
    called: at an idle point any of them is state a finished request left behind."""
    return [f"{name} ({len(value)})" for name, value in vars(owner).items()
            if isinstance(value, (dict, list, set)) and value]


def check_kv_idle(kv: KVCacheManager) -> list[str]:
    """With no request unfinished: every block free with ref count 0, the free queue and cached_blocks well
    formed, and no per-request state in the manager or its tiers' books."""
    pool = kv.pool
    problems = []
    held = [block for block in pool.blocks if block.ref_count != 0]
    if held:
        problems.append(f"pool not whole: {len(held)} blocks still referenced "
                        f"(e.g. {', '.join(repr(b) for b in held[:3])})")
    if pool.num_free_blocks != pool.num_blocks:
        problems.append(f"pool not whole: {pool.num_free_blocks} of {pool.num_blocks} blocks free")
    problems += check_free_queue(pool) + check_cached_blocks(pool)
    left = per_request_state(kv) + [state for books in kv.tiers.books for state in per_request_state(books)]
    if left:
        problems.append(f"the KV manager holds per-request state at an idle point: {', '.join(left)}")
    return problems
