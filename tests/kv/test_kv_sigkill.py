"""A process killed with SIGKILL in the middle of writing a KV block file leaves nothing that a restarted
engine serves wrong: the half-written temporary file is removed at start-up (and counted), and every prompt
gets the tokens of a cold engine without a disk tier."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.worker.kv_disk_store import BLOCK_SUFFIX, HEADER_BYTES, HOLD_MID_WRITE_ENV
from pagedllm.worker.model_runner import kv_bytes_per_block

BLOCK_SIZE = 8
POOL_BLOCKS = 6
PROMPT_A = list(range(10, 50))    # 5 full blocks
PROMPT_B = list(range(100, 140))  # with its outputs it takes all 6 blocks: A's 5 cached blocks spill
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
CHILD = Path(__file__).with_name("kv_writer_child.py")
SIGNAL_TIMEOUT_S = 300   # the child loads torch and a model first; a child that never signals fails the test


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-kvkill"), "llama")


def generate(llm: LLM, prompt: list[int]) -> list[int]:
    (output,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    return list(output.outputs[0].token_ids)


def kill_mid_write(tiny_dir: Path, kv_dir: Path, pool_bytes: int, fifo: Path) -> str:
    """Runs the child until its writer says it is half way through a block file, SIGKILLs it, and returns the
    name of the file it was writing."""
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # open before the child writes; read when it has
    prompts = [",".join(map(str, prompt)) for prompt in (PROMPT_A, PROMPT_B)]
    env = {**os.environ, HOLD_MID_WRITE_ENV: str(fifo),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(CHILD), str(tiny_dir), str(kv_dir), str(pool_bytes),
                              str(BLOCK_SIZE), *prompts], env=env, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([reader], [], [], SIGNAL_TIMEOUT_S)
        assert ready, "the child never reached the middle of a block write"
        message = os.read(reader, 4096).decode()
        assert message.endswith("\n"), f"the child died before its signal: {child.stderr.read().decode()[-2000:]}"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(reader)
        child.stderr.close()
    return message.strip()


def test_a_block_write_cut_by_sigkill_is_never_served_after_a_restart(tiny_dir, tmp_path):
    cold = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK_SIZE)
    expected = {"A": generate(cold, PROMPT_A), "B": generate(cold, PROMPT_B)}
    block_bytes = kv_bytes_per_block(cold.llm_engine.model_config, BLOCK_SIZE, cold.llm_engine.kv_cache_dtype)
    kv_dir = tmp_path / "kv"

    name = kill_mid_write(tiny_dir, kv_dir, POOL_BLOCKS * block_bytes, tmp_path / "mid-write")
    assert name.endswith(BLOCK_SUFFIX)
    temporary = [path for path in kv_dir.iterdir() if path.name.endswith(".tmp")]
    assert [path.name.startswith(f".{name}.") for path in temporary] == [True]
    assert 0 < temporary[0].stat().st_size < HEADER_BYTES + block_bytes   # cut half way
    assert not (kv_dir / name).exists()
    assert not [path for path in kv_dir.iterdir() if path.name.endswith(BLOCK_SUFFIX)]   # the first write was cut

    restarted = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=POOL_BLOCKS * block_bytes, block_size=BLOCK_SIZE,
                    kv_cache_dir=str(kv_dir))
    disk = restarted.llm_engine.stats().kv_disk
    assert (disk.stale_files_removed, disk.num_blocks) == (1, 0)
    assert not [path for path in kv_dir.iterdir() if path.name.endswith(".tmp")]
    assert generate(restarted, PROMPT_A) == expected["A"]
    assert generate(restarted, PROMPT_B) == expected["B"]    # spills A's blocks, whole this time
    restarted.llm_engine.flush_kv_disk_tier()
    assert generate(restarted, PROMPT_A) == expected["A"]    # A's prefix from the new files
    disk = restarted.llm_engine.stats().kv_disk
    assert disk.hit_blocks == 4 and disk.read_failures == 0
