"""The KV disk tier (--kv-cache-dir): blocks evicted from the RAM pool come back from disk with the same
greedy tokens, across restarts, never across tenants, never from a damaged file, never beyond the quota."""
from __future__ import annotations

import os
import stat

import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.server_process import ServerProcess, metric
from pagedllm.kv.disk_tier import DiskTier
from pagedllm.kv.manager import KVCacheManager
from pagedllm.worker.kv_disk_store import BLOCK_SUFFIX, HEADER_BYTES
from pagedllm.worker.model_runner import kv_bytes_per_block

BLOCK_SIZE = 8
POOL_BLOCKS = 6
PROMPT_A = list(range(10, 50))    # 40 tokens: 5 full blocks of 8
PROMPT_B = list(range(100, 140))  # 40 other tokens: with 2 outputs it takes all 6 blocks, evicting A's
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-kvdisk"), "llama")


@pytest.fixture(scope="module")
def block_bytes(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="1MiB", block_size=BLOCK_SIZE)
    return kv_bytes_per_block(llm.llm_engine.model_config, BLOCK_SIZE, llm.llm_engine.kv_cache_dtype)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Greedy tokens from an engine with a pool big enough for everything and no disk tier."""
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK_SIZE)
    return {name: generate(llm, prompt)[0] for name, prompt in (("A", PROMPT_A), ("B", PROMPT_B))}


def engine(tiny_dir, block_bytes, directory, disk_bytes=None, **kwargs) -> LLM:
    extra = {} if disk_bytes is None else {"kv_cache_disk_bytes": disk_bytes}
    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory=POOL_BLOCKS * block_bytes, block_size=BLOCK_SIZE,
               kv_cache_dir=str(directory), **extra, **kwargs)


def generate(llm: LLM, prompt: list[int], salt: str | None = None) -> tuple[list[int], int]:
    request = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})
    (output,) = llm.generate(request, GREEDY, use_tqdm=False)
    return list(output.outputs[0].token_ids), output.num_cached_tokens


def evict_a_then_rerun(llm: LLM, salt: str | None = None) -> tuple[list[int], int]:
    """Runs A, then B (whose 6 blocks evict A's 5 cached ones to disk), then A again."""
    generate(llm, PROMPT_A, salt)
    generate(llm, PROMPT_B)
    llm.llm_engine.flush_kv_disk_tier()
    return generate(llm, PROMPT_A, salt)


def block_files(directory) -> list:
    return sorted(path for path in directory.iterdir() if path.name.endswith(BLOCK_SUFFIX))


def test_a_prefix_evicted_from_ram_comes_back_from_disk_with_the_same_tokens(tiny_dir, block_bytes, reference,
                                                                             tmp_path):
    llm = engine(tiny_dir, block_bytes, tmp_path / "kv")
    assert llm.llm_engine.kv_manager.pool.num_blocks == POOL_BLOCKS
    disk = llm.llm_engine.kv_manager.disk
    assert generate(llm, PROMPT_A) == (reference["A"], 0)
    assert disk.counters.spills == 0   # nothing evicted yet
    assert generate(llm, PROMPT_B) == (reference["B"], 0)
    assert disk.counters.spills == 5   # B took all 6 blocks: A's 5 cached (full) blocks were spilled
    llm.llm_engine.flush_kv_disk_tier()
    assert len(block_files(tmp_path / "kv")) == 5
    # A's lookup covers 39 tokens, 4 full blocks, all on disk; they and A's 2 new blocks evict B's 5.
    assert generate(llm, PROMPT_A) == (reference["A"], 32)
    assert (disk.counters.hits, disk.counters.read_failures, disk.counters.spills) == (4, 0, 10)
    llm.llm_engine.flush_kv_disk_tier()
    assert len(block_files(tmp_path / "kv")) == len(disk) == 10
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(path).st_mode) for path in (tmp_path / "kv").iterdir()} == {0o600}


def test_a_restarted_engine_serves_earlier_prefixes_from_disk(tiny_dir, block_bytes, reference, tmp_path):
    first = engine(tiny_dir, block_bytes, tmp_path / "kv")
    evict_a_then_rerun(first)
    first.llm_engine.shutdown()
    (tmp_path / "kv" / ".leftover.kv.123.tmp").write_bytes(b"half a block")   # a write cut by SIGKILL
    restarted = engine(tiny_dir, block_bytes, tmp_path / "kv")
    disk = restarted.llm_engine.kv_manager.disk
    assert len(disk) == len(block_files(tmp_path / "kv"))
    assert not (tmp_path / "kv" / ".leftover.kv.123.tmp").exists()
    assert generate(restarted, PROMPT_A) == (reference["A"], 32)
    assert disk.counters.hits == 4


def test_damaged_block_files_are_refused_and_their_tokens_recomputed(tiny_dir, block_bytes, reference, tmp_path):
    first = engine(tiny_dir, block_bytes, tmp_path / "kv")
    evict_a_then_rerun(first)
    first.llm_engine.shutdown()
    files = block_files(tmp_path / "kv")
    for path in files:   # one payload byte flipped: the length is right, the checksum is not
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 7] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = engine(tiny_dir, block_bytes, tmp_path / "kv")
    disk = restarted.llm_engine.kv_manager.disk
    assert generate(restarted, PROMPT_A) == (reference["A"], 0)
    assert (disk.counters.hits, disk.counters.read_failures) == (0, 4)   # all 4 loads were tried in one step
    for path in block_files(tmp_path / "kv"):   # truncated: not even indexed at the next start
        path.write_bytes(path.read_bytes()[:HEADER_BYTES + 5])
    again = engine(tiny_dir, block_bytes, tmp_path / "kv")
    assert len(again.llm_engine.kv_manager.disk) == 0
    assert generate(again, PROMPT_A) == (reference["A"], 0)


def test_a_quota_smaller_than_a_block_stops_spilling_but_no_request(tiny_dir, block_bytes, reference, tmp_path):
    llm = engine(tiny_dir, block_bytes, tmp_path / "kv", disk_bytes=block_bytes)   # the header does not fit
    disk = llm.llm_engine.kv_manager.disk
    assert disk.capacity_blocks == 0
    assert evict_a_then_rerun(llm) == (reference["A"], 0)
    assert disk.counters.spills == 0 and block_files(tmp_path / "kv") == []


def test_the_quota_keeps_the_most_recently_used_blocks(tiny_dir, block_bytes, reference, tmp_path):
    llm = engine(tiny_dir, block_bytes, tmp_path / "kv", disk_bytes=2 * (HEADER_BYTES + block_bytes))
    disk = llm.llm_engine.kv_manager.disk
    tokens, cached = evict_a_then_rerun(llm)
    # B evicts A's 5 cached blocks last first (A freed them so), so the 2 kept are A's first two: A hits 16
    # tokens. Loading them and A's 4 more blocks evict B's 5, of which 2 are kept: 10 spills, 8 evictions.
    assert (disk.counters.spills, disk.counters.evictions, disk.counters.hits) == (10, 8, 2)
    assert (tokens, cached) == (reference["A"], 16)
    llm.llm_engine.flush_kv_disk_tier()
    assert len(block_files(tmp_path / "kv")) == 2


def test_another_salt_never_gets_the_blocks_from_disk(tiny_dir, block_bytes, reference, tmp_path):
    llm = engine(tiny_dir, block_bytes, tmp_path / "kv")
    disk = llm.llm_engine.kv_manager.disk
    generate(llm, PROMPT_A, salt="alice")
    generate(llm, PROMPT_B)
    llm.llm_engine.flush_kv_disk_tier()
    assert generate(llm, PROMPT_A, salt="bob") == (reference["A"], 0)
    assert generate(llm, PROMPT_A) == (reference["A"], 0)
    assert disk.counters.hits == 0
    assert generate(llm, PROMPT_A, salt="alice") == (reference["A"], 32)
    assert disk.counters.hits == 4


def test_a_directory_made_for_another_layout_is_refused_with_the_reason(tiny_dir, block_bytes, tmp_path):
    engine(tiny_dir, block_bytes, tmp_path / "kv")
    with pytest.raises(ValueError, match="block_size 8 there, 16 here"):
        LLM(str(tiny_dir), dtype="float32", kv_cache_memory="1MiB", block_size=16, kv_cache_dir=str(tmp_path / "kv"))
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32' there, 'bfloat16' here"):
        LLM(str(tiny_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory="1MiB", block_size=BLOCK_SIZE,
            kv_cache_dir=str(tmp_path / "kv"))


def test_the_manager_spills_evicted_blocks_and_loads_a_disk_prefix_into_held_blocks():
    """Bookkeeping alone, block counts by hand: 4 blocks, a 3-block prefix evicted, then found on disk."""
    kv = KVCacheManager(4, 4, disk_tier=DiskTier(capacity_blocks=8))
    prompt = list(range(13))   # 3 full blocks of 4 + 1
    assert kv.allocate_slots("a", 13, 0) and kv.tiers.take_work().spills == []
    kv.cache_full_blocks("a", prompt, 13)
    kv.free("a")
    assert kv.allocate_slots("b", 16, 0)   # takes all 4: evicts a's 3 cached blocks
    work = kv.tiers.take_work()
    assert len(work.spills) == 3 and len(kv.disk) == 3
    kv.free("b")
    hits = kv.get_computed_blocks("a2", prompt)
    assert hits == [] and kv.load_from_disk("a2", prompt, hits)
    loads = kv.tiers.take_work().loads
    assert [block_hash for _, block_hash, _ in loads] == kv._block_hashes["a2"]
    assert kv.pool.num_free_blocks == 1 and kv.tiers.is_loading("a2")
    kv.complete_disk_loads(failed_block_ids=[loads[2][0]])   # the third could not be read
    assert (kv.disk.counters.hits, kv.disk.counters.read_failures, len(kv.disk)) == (2, 1, 2)
    hits = kv.get_computed_blocks("a2", prompt)
    assert [block.block_id for block in hits] == [loads[0][0], loads[1][0]]
    assert not kv.load_from_disk("a2", prompt, hits)   # the third is gone from disk: it is recomputed
    assert kv.allocate_slots("a2", 13, 8, hits)
    assert kv.pool.num_free_blocks == 0 and all(block.ref_count == 1 for block in hits)
    kv.free("a2")
    assert kv.pool.num_free_blocks == 4


def test_through_the_server_tenants_stay_apart_on_disk_and_usage_and_metrics_count_disk_hits(
        tiny_dir, block_bytes, reference, tmp_path):
    """Two API keys (tenants, so two salts) on `pagedllm serve --kv-cache-dir`: the official openai client
    sees cached_tokens from disk for its own tenant only, and /metrics counts the disk tier's blocks."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("alice-key: alice\nbob-key: bob\n")
    server = ServerProcess(tmp_path / "server.log", str(tiny_dir), "--dtype", "float32", "--block-size",
                           str(BLOCK_SIZE), "--kv-cache-memory", str(POOL_BLOCKS * block_bytes), "--kv-cache-dir",
                           str(tmp_path / "kv"), "--api-keys-file", str(keys), api_key="admin-key")
    try:
        def complete(key: str, prompt: list[int]):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)
            response = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                                 max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
            return response.usage.prompt_tokens_details.cached_tokens

        assert complete("alice-key", PROMPT_A) == 0
        assert complete("alice-key", PROMPT_B) == 0   # evicts A's 5 blocks to disk
        assert complete("bob-key", PROMPT_A) == 0     # bob's salt: no hit in RAM or on disk
        figures = server.metrics_text()
        assert metric(figures, "pagedllm:kv_tier_hit_blocks_total", tier="disk") == 0
        assert complete("alice-key", PROMPT_A) == 32
        figures = server.metrics_text()
        assert metric(figures, "pagedllm:kv_tier_hit_blocks_total", tier="disk") == 4
        assert metric(figures, "pagedllm:kv_tier_read_failures_total", tier="disk") == 0
        assert metric(figures, "pagedllm:kv_tier_spilled_blocks_total", tier="disk") >= 5
        assert metric(figures, "pagedllm:kv_tier_capacity_blocks", tier="disk") == 8 * 2**30 // (
            HEADER_BYTES + block_bytes)
    finally:
        server.stop()
