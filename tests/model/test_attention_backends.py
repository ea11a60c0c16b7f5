"""Choosing the attention backend once per engine, the engine on the Triton backend (under Triton's interpreter on
CPU) against the C++ kernels, and the CUDA engine details that can be checked without a GPU."""
import logging

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ATTENTION_BACKENDS, EngineConfig
from pagedllm.config.resolve import gpu_kv_cache_budget
from pagedllm.entrypoints.cli import parse_args
from pagedllm.model.attention import selector
from pagedllm.model.attention.selector import FORCE_VARIABLE, select_attention_backend
from pagedllm.worker.host_staging import HostStaging, fetch

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def select(requested, device=CPU, head_dim=64, cache_dtype=torch.float32):
    return select_attention_backend(requested, device, head_dim, 16, torch.float32, cache_dtype)


def test_config_names_the_backends_the_selection_knows():
    assert ATTENTION_BACKENDS == ("auto", *selector.BACKEND_NAMES)
    with pytest.raises(ValueError, match="attention_backend must be one of auto, cpu, triton, torch, got 'flash'"):
        EngineConfig(attention_backend="flash")
    assert parse_args(["generate", "hi", "--attention-backend", "torch"]).attention_backend == "torch"


@pytest.mark.kernels
def test_auto_takes_the_cpu_kernels_on_cpu_and_the_reference_where_they_cannot_serve(monkeypatch):
    monkeypatch.delenv(FORCE_VARIABLE, raising=False)
    assert select("auto").name == "cpu" and select("auto").uses_cpu_kernels
    assert select("auto", head_dim=24).name == "torch"   # the C++ kernels vectorise multiples of 16 only
    with pytest.raises(ValueError, match="attention_backend 'cpu' needs .* head_dim 24"):
        select("cpu", head_dim=24)


def test_the_environment_variable_names_the_backend_when_the_argument_is_auto(monkeypatch):
    monkeypatch.setenv(FORCE_VARIABLE, "torch")
    assert select("auto").name == "torch"
    if selector.kernels is not None:
        assert select("cpu").name == "cpu"   # an explicit argument wins
    monkeypatch.setenv(FORCE_VARIABLE, "sdpa")
    with pytest.raises(ValueError, match=f"{FORCE_VARIABLE} must be one of auto, cpu, triton, torch, got 'sdpa'"):
        select("auto")


@pytest.mark.triton
def test_triton_backend_refuses_a_cpu_without_the_interpreter(monkeypatch):
    triton_kernels = pytest.importorskip("pagedllm.model.attention.triton_kernels", reason="triton is not installed")
    monkeypatch.setattr(triton_kernels, "INTERPRETED", False)
    with pytest.raises(ValueError, match="runs only under Triton's interpreter: set TRITON_INTERPRET=1"):
        select("triton")


def test_kv_cache_budget_is_the_engines_share_less_what_the_profile_run_showed():
    gib = 2**30
    # 80 GiB device at 0.9: 72 GiB for the engine; 10 GiB peak of tensors, 1.5 GiB CUDA context and others
    assert gpu_kv_cache_budget(80 * gib, 0.9, 10 * gib, 3 * gib // 2) == 72 * gib - 10 * gib - 3 * gib // 2
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.1 .* no room for a KV cache"):
        gpu_kv_cache_budget(80 * gib, 0.1, 10 * gib, 0)


def test_profile_run_leaves_the_cache_and_the_batch_alone(make_tiny_model_dir, tmp_path):
    """The profile run (the largest step, on a scratch cache) runs on CPU too; it measures nothing there, and
    touches neither the engine's cache nor its batch: generation afterwards is what it would have been."""
    folder = str(make_tiny_model_dir(tmp_path, "llama"))
    llm = LLM(folder, dtype="float32", device="cpu", kv_cache_memory="1MiB", max_num_batched_tokens=64)
    runner = llm.llm_engine.runner
    before = [cache.data.clone() for layer in runner.kv_caches for cache in layer]
    assert runner.profile_run(64, 8) == 0
    assert all(torch.equal(old, cache.data) for old, cache in zip(before, (c for layer in runner.kv_caches for c in layer)))
    assert not runner.input_batch.req_ids
    prompt = {"prompt_token_ids": list(range(30, 50))}
    params = SamplingParams(temperature=0, max_tokens=3)
    fresh = LLM(folder, dtype="float32", device="cpu", kv_cache_memory="1MiB")
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        fresh.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_host_staging_on_cpu_shares_the_arrays_and_fetch_reads_back_lists():
    staging = HostStaging(CPU)
    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    tensor = staging.to_device("block_tables", array)
    assert tensor.tolist() == array.tolist() and not staging.buffers
    assert fetch([torch.tensor([3, 4]), None, torch.tensor([[0.5]])]) == [[3, 4], None, [[0.5]]]


@pytest.mark.triton
def test_engine_on_the_triton_backend_gives_the_cpu_kernels_tokens(caplog):
    """The bundled model in float32 with float weights (quantization none: the Q4_1 matmuls quantize their inputs
    to int8, so a 1e-6 difference in an activation may move a rounding and the tokens), a few greedy requests: a prompt chunked over steps (max_num_batched_tokens)
    beside short ones that decode meanwhile; then one that shares its first blocks (a prefill after a cached
    prefix) beside a whole new prompt."""
    pytest.importorskip("pagedllm.model.attention.triton_kernels", reason="triton is not installed")
    shared = list(range(100, 140))
    rounds = [[{"prompt_token_ids": shared}, "Hi"],   # "Hi" is one token: it joins the chunk's second step as a row of one
              [{"prompt_token_ids": shared + [7, 8, 9]}, "The capital of France is"]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = {}
    # On CPU the C++ kernels are the reference; on a GPU the PyTorch one, so that only attention differs.
    reference = "cpu" if DEVICE.type == "cpu" and selector.kernels is not None else "torch"
    for backend in (reference, "triton"):
        with caplog.at_level(logging.INFO, logger="pagedllm.engine.llm_engine"):
            llm = LLM(dtype="float32", quantization="none", device=DEVICE.type, attention_backend=backend,
                      kv_cache_memory="16MiB", max_num_batched_tokens=24)
        described = llm.llm_engine.runner.attention_backend.describe()   # the cpu one names its prefill path
        assert described.split(" ")[0] == backend and f"attention backend {described}," in caplog.text
        tokens[backend] = [list(output.outputs[0].token_ids) for prompts in rounds
                           for output in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats().kv_cache.prefix_cache_hits >= 32   # the second round's first two blocks
    reference, triton_tokens = tokens.values()
    assert triton_tokens == reference
