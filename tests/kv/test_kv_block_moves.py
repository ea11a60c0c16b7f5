"""The workers' side of the KV tiers: a step's blocks copied out and back in at once (every cache tensor, int8
scales included), and block files read ahead for loads to come."""
from __future__ import annotations

import torch

from pagedllm.kv.disk_tier import DiskTier
from pagedllm.kv.invariants import check_kv_idle
from pagedllm.kv.manager import KVCacheManager
from pagedllm.model.attention.cache import CacheTensor
from pagedllm.worker.kv_disk_store import BLOCK_SUFFIX, HEADER_BYTES, DiskKVStore, copy_blocks_in, copy_blocks_out


def caches(num_blocks: int) -> list[tuple[CacheTensor, CacheTensor]]:
    """Two layers: bfloat16 K/V, and int8 K/V with float32 scales, filled with distinct values."""
    generator = torch.Generator().manual_seed(0)
    def tensor(shape, dtype):
        return torch.randint(-100, 100, shape, generator=generator).to(dtype)
    bf16 = (CacheTensor(tensor((num_blocks, 2, 8, 4), torch.bfloat16)), CacheTensor(tensor((num_blocks, 2, 8, 4), torch.bfloat16)))
    int8 = tuple(CacheTensor(tensor((num_blocks, 2, 8, 4), torch.int8), tensor((num_blocks, 2, 8), torch.float32))
                 for _ in range(2))
    return [bf16, int8]


def block(kv_caches, block_id: int) -> list[torch.Tensor]:
    return [tensor[block_id].clone() for layer in kv_caches for cache in layer
            for tensor in (cache.data, cache.scales) if tensor is not None]


def test_blocks_copied_out_together_come_back_byte_for_byte_into_other_blocks():
    kv_caches = caches(6)
    before = {block_id: block(kv_caches, block_id) for block_id in (4, 1, 2)}
    payloads = copy_blocks_out(kv_caches, [4, 1, 2])
    # one row per block: 2 x 64 bf16 elements, then 2 x (64 int8 + 16 float32 scales) per int8 layer
    assert payloads.shape == (3, 2 * 64 * 2 + 2 * (64 + 16 * 4))
    copy_blocks_in(kv_caches, [0, 5, 3], payloads)
    for source, destination in ((4, 0), (1, 5), (2, 3)):
        assert all(torch.equal(a, b) for a, b in zip(before[source], block(kv_caches, destination)))
    assert all(torch.equal(a, b) for a, b in zip(before[4], block(kv_caches, 4)))   # sources untouched


def test_a_block_read_ahead_is_checked_then_served_from_memory_once(tmp_path):
    store = DiskKVStore(str(tmp_path), payload_bytes=64, read_ahead_blocks=4)
    payload, block_hash, digest = torch.arange(64, dtype=torch.uint8), b"\x01" * 32, b"\x02" * 32
    store.write(block_hash, digest, payload)
    store.flush()
    store.read_ahead(block_hash, digest)
    store.flush()
    assert store.bytes_read == HEADER_BYTES + 64   # read and checked by the read-ahead thread
    (tmp_path / (block_hash.hex() + BLOCK_SUFFIX)).unlink()   # so the load below can only be served from memory
    assert store.read(block_hash, b"\x03" * 32) is None   # another key never gets it
    assert torch.equal(store.read(block_hash, digest), payload)
    assert store.read(block_hash, digest) is None   # taken once
    store.close()


def test_a_damaged_file_read_ahead_is_refused_and_not_kept(tmp_path):
    store = DiskKVStore(str(tmp_path), payload_bytes=64, read_ahead_blocks=4)
    block_hash, digest = b"\x01" * 32, b"\x02" * 32
    store.write(block_hash, digest, torch.arange(64, dtype=torch.uint8))
    store.flush()
    path = tmp_path / (block_hash.hex() + BLOCK_SUFFIX)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    store.read_ahead(block_hash, digest)
    store.flush()
    assert not path.exists() and store.read(block_hash, digest) is None
    store.close()


def test_a_waiting_request_that_cannot_load_yet_has_its_disk_blocks_read_ahead_once():
    kv = KVCacheManager(num_blocks=4, block_size=4, disk_tier=DiskTier(8))
    prompt = list(range(13))   # 3 full blocks and one token
    assert kv.allocate_slots("a", 13, 0)
    kv.cache_full_blocks("a", prompt, 13)
    kv.free("a")
    assert kv.allocate_slots("b", 16, 0)   # takes all 4 blocks: a's 3 cached blocks spill
    spilled = [(block_hash, digest) for _, block_hash, digest in kv.tiers.take_work().spills]
    assert len(spilled) == 3
    for _ in range(2):   # b holds every block: a2 cannot load, and its blocks are named once
        hits = kv.get_computed_blocks("a2", prompt)
        assert not kv.load_from_disk("a2", prompt, hits)
    work = kv.tiers.take_work()
    assert sorted(work.read_ahead) == sorted(spilled) and work.loads == []   # named in prefix order
    kv.free("b")
    assert kv.load_from_disk("a2", prompt, kv.get_computed_blocks("a2", prompt))
    assert [block_hash for _, block_hash, _ in kv.tiers.take_work().loads] == [h for h, _ in work.read_ahead]
    kv.complete_disk_loads([])
    problems = check_kv_idle(kv)   # a2 never ended: the idle check sees what the tier's books hold for it
    assert "_read_ahead_for (1)" in problems[-1] and "_staged (1)" in problems[-1]
    kv.free("a2")
    assert check_kv_idle(kv) == []
