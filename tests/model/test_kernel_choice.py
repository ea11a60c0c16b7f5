"""Choose once: every op takes its compiled kernel (or the torch formula) when its layer is built, never per
call, and an op that falls to torch is logged with the reason."""
import logging
from collections import Counter

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model import kernels, ops
from pagedllm.model.attention.prefill_path import choose_prefill_path
from pagedllm.model.quantized_matmul import QuantizedMatmul
from pagedllm.model.rope import RotaryEmbedding

CPU = torch.device("cpu")


class CountingKernels:
    """Stands in for the compiled module and counts which kernels are looked up on it."""

    def __init__(self, module):
        self.module = module
        self.lookups = Counter()

    def __getattr__(self, name):
        self.lookups[name] += 1
        return getattr(self.module, name)


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """An empty record of logged torch paths, so this test's choices log again."""
    monkeypatch.setattr(kernels, "_logged_torch_paths", set())
    caplog.set_level(logging.INFO, logger=kernels.__name__)
    return caplog


@pytest.mark.skipif(kernels.kernels is None, reason="the C++ kernels are not built")
def test_kernels_are_looked_up_when_the_model_is_built_and_never_per_step(make_tiny_model_dir, tmp_path, monkeypatch):
    counting = CountingKernels(kernels.kernels)
    monkeypatch.setattr(kernels, "kernels", counting)
    llm = LLM(str(make_tiny_model_dir(tmp_path, "llama")), dtype="float32", kv_cache_memory="16MiB")
    built = dict(counting.lookups)
    prefill = set(choose_prefill_path(torch.float32, torch.float32).ops)   # the tiles, and brgemm on AVX2 or AVX-512
    assert {"rms_norm", "add_rms_norm", "silu_and_mul", "write_kv", "paged_attention"} | prefill <= set(built)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": list(range(7, 30))}],
                 SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert dict(counting.lookups) == built, "a step looked a kernel up again"


def test_without_the_build_every_op_is_torch_and_logged_once(fresh_log, monkeypatch):
    monkeypatch.setattr(kernels, "kernels", None)
    assert ops.rms_norm_op(CPU, 64) is ops.rms_norm_torch
    assert ops.rms_norm_op(CPU, 128) is ops.rms_norm_torch
    assert ops.gated_activation("silu", CPU, 64) is ops.silu_and_mul
    assert RotaryEmbedding(64, 16, 10000.0, None, CPU).kernel is None
    assert QuantizedMatmul().kernel(torch.float32, 1) is None
    messages = [record.getMessage() for record in fresh_log.records]
    assert messages.count("rms_norm: the torch path serves (the C++ kernels are not built)") == 1
    assert "silu_and_mul: the torch path serves (the C++ kernels are not built)" in messages
    assert "rotary_embedding: the torch path serves (the C++ kernels are not built)" in messages


@pytest.mark.skipif(kernels.kernels is None, reason="the C++ kernels are not built")
def test_shapes_and_devices_the_kernels_do_not_take_are_decided_and_logged(fresh_log):
    assert ops.rms_norm_op(CPU, 24) is ops.rms_norm_torch
    assert ops.gated_activation("silu", CPU, 24) is ops.silu_and_mul
    assert RotaryEmbedding(48, 16, 10000.0, None, CPU).kernel is None
    assert ops.rms_norm_op(torch.device("cuda"), 64) is ops.rms_norm_torch
    assert QuantizedMatmul(device=torch.device("cuda")).kernel(torch.float32, 1) is None
    assert ops.rms_norm_op(CPU, 64) is not ops.rms_norm_torch
    messages = [record.getMessage() for record in fresh_log.records]
    assert "rms_norm: the torch path serves (rows of 24, not a multiple of 16)" in messages
    assert "silu_and_mul: the torch path serves (rows of 24, not a multiple of 16)" in messages
    assert "rotary_embedding: the torch path serves (rotary_dim 48, not a multiple of 32)" in messages
    assert "rms_norm: the torch path serves (a cuda device)" in messages
