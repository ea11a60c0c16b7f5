"""Tensor parallelism: TP ranks against one process on the same model, a worker killed mid-generation,
no process left behind, and sizes that do not split.

The reference is a single-process engine (tensor_parallel_size 1) on the same checkpoint; it is checked
against transformers elsewhere (test_model_vs_transformers.py).
"""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.executor.multiproc_executor import WorkerDiedError
from pagedllm.entrypoints.cli import parse_args

GREEDY_TOP2 = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
LOGPROB_TOLERANCE = 1e-4
NEAR_TIE = 1e-3      # top-1 minus top-2 logprob at or below this: either token may rightly win
MOST = 0.8           # at least this share of positions must be compared, or the test would prove nothing
DEATH_BOUND_SECONDS = 60   # an upper bound that fails loudly, not a timing


@pytest.fixture
def one_thread():
    """One torch thread for the reference (each TP rank gets cores // tp_size, one on this machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def is_resource_tracker(process: psutil.Process) -> bool:
    """multiprocessing's one helper per interpreter, started with the first spawned process and ended
    with the interpreter (see test_no_process_left_at_interpreter_exit); not the engine's to stop, as
    other code in the process may rely on it."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False


def spawned_children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def new_live_children(before: set[int]) -> list[psutil.Process]:
    """Processes started by this test that still exist (zombies count: nobody reaped them)."""
    return [child for child in psutil.Process().children(recursive=True)
            if child.pid not in before and not is_resource_tracker(child)]


def prompts_for(vocab_size: int, count: int = 4) -> list[dict]:
    generator = torch.Generator().manual_seed(7)
    return [{"prompt_token_ids": torch.randint(3, vocab_size, (length,), generator=generator).tolist()}
            for length in (5, 17, 33, 9)[:count]]


def assert_same_generation(reference: list, candidate: list) -> None:
    """Greedy tokens identical and logprobs within LOGPROB_TOLERANCE wherever the
    reference's top-1 beats its top-2 by more than NEAR_TIE. At a near tie either token is right: the
    position is not checked, and if the two picked differently the rest of that sequence is not either.
    At least the share MOST of the positions must be checked."""
    compared = total = 0
    for ref_output, got_output in zip(reference, candidate, strict=True):
        ref, got = ref_output.outputs[0], got_output.outputs[0]
        total += len(ref.token_ids)
        for position, (ref_token, ref_entry) in enumerate(zip(ref.token_ids, ref.logprobs)):
            ranked = sorted(ref_entry.values(), key=lambda entry: entry.rank)
            top1, top2 = (entry for entry in ranked if entry.rank in (1, 2))
            if top1.logprob - top2.logprob <= NEAR_TIE:
                if got.token_ids[position] != ref_token:
                    break
                continue
            compared += 1
            assert got.token_ids[position] == ref_token, f"token {position} differs"
            got_logprob = got.logprobs[position][ref_token].logprob
            assert abs(got_logprob - top1.logprob) <= LOGPROB_TOLERANCE, (
                f"token {position}: logprob {got_logprob} vs {top1.logprob}")
    assert compared >= MOST * total, f"only {compared} of {total} positions were clear of near ties"


TINY_CASES = {
    "llama": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "tied-embeddings": ("llama", {"tie_word_embeddings": True}),
    "one-kv-head-replicated": ("llama", {"num_key_value_heads": 1}),
    # Norms (four per layer, q/k norms) whole on each rank; soft-caps, windows, local rope, scaled embedding.
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    # Every expert's intermediate size split over the ranks, the routing replicated; a dense layer beside.
    "mixtral-experts": ("mixtral", {}),
    "qwen2moe-shared-expert": ("qwen2moe", {}),
    "qwen3moe-sparse-every-second-layer": ("qwen3moe", {}),
}


@pytest.mark.parametrize("case", TINY_CASES)
def test_tp2_matches_one_process_on_tiny_models(case, make_tiny_model_dir, tmp_path, one_thread):
    arch, overrides = TINY_CASES[case]
    folder = str(make_tiny_model_dir(tmp_path, arch, **overrides))
    prompts = prompts_for(256)
    settings = dict(dtype="float32", kv_cache_memory="8MiB")
    reference = LLM(folder, **settings).generate(prompts, GREEDY_TOP2, use_tqdm=False)
    llm = LLM(folder, tensor_parallel_size=2, **settings)
    try:
        assert len(llm.llm_engine.executor.workers) == 1
        assert_same_generation(reference, llm.generate(prompts, GREEDY_TOP2, use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()


BUNDLED_TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_tp3_matches_one_process_on_the_bundled_model(quantization, one_thread):
    """9 query heads and 3 KV heads: one KV head per rank. auto keeps the GGUF's Q4_1 weights, cut
    into whole groups before tiling; none dequantizes to float32. Either way a rank multiplies float32
    activations by its own rows or columns of the same weights (activation_dtype model: AVX2 builds would otherwise
    round many rows to int16, where a reordered float32 sum can move a value across a rounding step), so TP only
    reorders float32 sums: the float path's bounds hold for both."""
    settings = dict(dtype="float32", quantization=quantization, activation_dtype="model", kv_cache_memory="32MiB")
    reference_llm = LLM(**settings)
    tokenizer = reference_llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(text)} for text in BUNDLED_TEXTS]
    reference = reference_llm.generate(prompts, GREEDY_TOP2, use_tqdm=False)
    del reference_llm
    llm = LLM(tensor_parallel_size=3, **settings)
    try:
        engine = llm.llm_engine
        assert engine.runner.model.layers[0].num_kv_heads == 1
        assert engine.runner.kv_caches[0][0].data.shape[1] == 1   # [blocks, kv heads, ...]: its one KV head
        assert_same_generation(reference, llm.generate(prompts, GREEDY_TOP2, use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()


def test_kv_cache_memory_is_per_rank(make_tiny_model_dir, tmp_path):
    """Each rank caches its own KV heads, so the same per-rank budget holds tp_size times the blocks."""
    folder = str(make_tiny_model_dir(tmp_path, "llama"))
    one = LLM(folder, dtype="float32", kv_cache_memory="8MiB")
    two = LLM(folder, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    try:
        assert two.llm_engine.kv_manager.pool.num_blocks == 2 * one.llm_engine.kv_manager.pool.num_blocks
    finally:
        two.llm_engine.shutdown()


def run_bounded(function) -> BaseException | None:
    """Runs function on a thread; returns what it raised (None if nothing). Fails if it has not returned
    within DEATH_BOUND_SECONDS: a hang."""
    raised: list[BaseException | None] = [None]

    def target():
        try:
            function()
        except BaseException as exc:
            raised[0] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEATH_BOUND_SECONDS)
    assert not thread.is_alive(), f"still running after {DEATH_BOUND_SECONDS} s: a dead worker hung the engine"
    return raised[0]


def test_a_worker_killed_inside_a_step_fails_generation_quickly(make_tiny_model_dir, tmp_path):
    """SIGKILL of rank 1 after the third step went out to the workers and before rank 0's forward: rank 0
    then meets a dead peer in its collectives, and generate() raises instead of hanging."""
    folder = str(make_tiny_model_dir(tmp_path, "llama"))
    before = spawned_children()
    llm = LLM(folder, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    engine = llm.llm_engine
    (rank1,) = new_live_children(before)
    driver = engine.executor.driver_worker
    real_execute, steps = driver.execute_model, []

    def execute_model(*args, **kwargs):
        steps.append(1)
        if len(steps) == 3:
            os.kill(rank1.pid, signal.SIGKILL)
        return real_execute(*args, **kwargs)

    driver.execute_model = execute_model
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    raised = run_bounded(lambda: llm.generate(prompts_for(256, 2), params, use_tqdm=False))
    assert isinstance(raised, WorkerDiedError), raised
    assert f"rank 1 (pid {rank1.pid}) exited with code -{signal.SIGKILL.value}" in str(raised)
    assert len(steps) == 3
    with pytest.raises(WorkerDiedError):   # and it stays failed
        engine.step()
    engine.shutdown()
    assert not new_live_children(before)


def test_a_worker_killed_between_steps_fails_the_next_step(make_tiny_model_dir, tmp_path):
    folder = str(make_tiny_model_dir(tmp_path, "llama"))
    before = spawned_children()
    llm = LLM(folder, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    engine = llm.llm_engine
    engine.add_request("r", prompts_for(256, 1)[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    (worker,) = engine.executor.workers
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.join(DEATH_BOUND_SECONDS)   # reaped by its parent, as the executor's monitor sees it
    raised = run_bounded(engine.step)
    assert isinstance(raised, WorkerDiedError) and "rank 1" in str(raised), raised
    engine.shutdown()
    assert not new_live_children(before)


def test_no_process_left_after_shutdown_or_when_the_llm_goes_away(make_tiny_model_dir, tmp_path):
    folder = str(make_tiny_model_dir(tmp_path, "llama"))
    before = spawned_children()
    llm = LLM(folder, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    assert len(new_live_children(before)) == 1
    llm.llm_engine.shutdown()
    llm.llm_engine.shutdown()   # idempotent
    assert not new_live_children(before)
    assert torch.distributed.is_initialized() is False

    llm = LLM(folder, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    assert len(new_live_children(before)) == 1
    del llm
    gc.collect()
    assert not new_live_children(before)


def test_no_process_left_at_interpreter_exit(make_tiny_model_dir, tmp_path):
    """A script that never shuts its engine down: its workers end with it."""
    folder = make_tiny_model_dir(tmp_path, "llama")
    script = textwrap.dedent(f"""
        import psutil
        from pagedllm import LLM
        if __name__ == "__main__":
            llm = LLM({str(folder)!r}, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
            print(*[child.pid for child in psutil.Process().children(recursive=True)])
    """)
    path = tmp_path / "script.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=os.environ,
                          timeout=DEATH_BOUND_SECONDS * 3, check=True)
    pids = [int(pid) for pid in done.stdout.split()]
    assert pids, done.stderr
    # They end as the script's end reaches them (the resource tracker on its pipe's EOF): waited for, bounded.
    children = []
    for pid in pids:
        try:
            children.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, survivors = psutil.wait_procs(children, timeout=DEATH_BOUND_SECONDS)
    assert not [child for child in survivors if child.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("overrides, tp_size, quantization, message", [
    ({}, 3, "auto", r"tensor_parallel_size must divide num_attention_heads \(4\), got 3"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96}, 3, "auto",
     r"must divide num_key_value_heads \(2\) or be a multiple of it.*got 3"),
    ({"intermediate_size": 129}, 2, "auto", r"must divide intermediate_size \(129\), got 2"),
    ({"vocab_size": 257}, 2, "auto", r"must divide vocab_size \(257\), got 2"),
    ({}, 4, "int8", r"num_attention_heads \* head_dim \(64\) / tensor_parallel_size \(4\) must be a multiple of 32"),
])
def test_sizes_that_do_not_split_are_refused_before_any_process_starts(overrides, tp_size, quantization, message,
                                                                        make_tiny_model_dir, tmp_path):
    folder = str(make_tiny_model_dir(tmp_path, "llama", **overrides))
    before = spawned_children()
    with pytest.raises(ValueError, match=message):
        LLM(folder, dtype="float32", kv_cache_memory="8MiB", quantization=quantization,
            tensor_parallel_size=tp_size)
    assert not new_live_children(before)


def test_the_bundled_model_does_not_split_in_two():
    with pytest.raises(ValueError, match=r"must divide num_attention_heads \(9\), got 2"):
        LLM(tensor_parallel_size=2)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_tensor_parallel_size_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=value)


def test_the_flag_and_the_config_file_set_it(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("engine_args:\n  tensor_parallel_size: 3\n")
    assert parse_args(["serve", "--config", str(path)]).engine_config.tensor_parallel_size == 3
    assert parse_args(["generate", "Hi", "--tensor-parallel-size", "2"]).engine_config.tensor_parallel_size == 2
