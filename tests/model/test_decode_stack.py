"""The compiled decode stack (pagedllm/model/decode_stack.py) against the Python layers it stands in for.

It runs the same kernels in the same order on the same inputs, so nothing may differ: every token and every
top-5 logprob of a greedy run is asserted bitwise equal between PAGEDLLM_DECODE_STACK=1 and =0, in each case
the stack covers (weight formats, dtypes, KV cache dtypes, matmul paths by batch size, qkv bias, sliding
windows, partial and length-dependent rope, the int16 and int8 activation and batch-invariant modes). torch.profiler's
count of `pagedllm::decode_layers` shows which path each run took. The Python layers themselves are held to
transformers by test_model_vs_transformers.py and test_default_vs_reference.py (which runs the stack: the
bundled model's default is one of the cases it covers).
"""
from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.decode_stack import FORCE_VARIABLE
from pagedllm.model.quantized_matmul import int16_is_faster

pytestmark = pytest.mark.kernels

HEAD_DIM_32 = dict(hidden_size=128, intermediate_size=256)   # 4 heads of 32: the rope kernel's smallest head
# Token ids within the tiny models' 256-token vocabulary, of lengths 5 to 16.
PROMPTS = [{"prompt_token_ids": [(7 * i + 13 * j) % 250 + 3 for j in range(5 + i)]} for i in range(12)]


def greedy_run(monkeypatch, model: str, num_prompts: int, stack: bool, max_tokens: int = 40,
               event: str = "pagedllm::decode_layers", **engine_args):
    """Each prompt's tokens and top-5 logprobs, and how many steps ran the compiled stack (by default; how many
    times torch.profiler saw `event`)."""
    monkeypatch.setenv(FORCE_VARIABLE, "1" if stack else "0")
    llm = LLM(model, kv_cache_memory="16MiB", enable_prefix_caching=False, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        outputs = llm.generate(PROMPTS[:num_prompts], params, use_tqdm=False)
    steps = sum(seen.count for seen in profiler.key_averages() if seen.key == event)
    results = [(list(o.outputs[0].token_ids),
                [sorted((token, entry.logprob) for token, entry in position.items()) for position in o.outputs[0].logprobs])
               for o in outputs]
    return results, steps, llm


CASES = {
    # name: (arch, config overrides, prompts, engine arguments)
    "int4-float32-1": ("llama", HEAD_DIM_32, 1, dict(quantization="int4", dtype="float32")),
    "int8-bfloat16-3": ("llama", HEAD_DIM_32, 3, dict(quantization="int8", dtype="bfloat16")),
    "int4-bfloat16-12-brgemm": ("llama", HEAD_DIM_32, 12, dict(quantization="int4", dtype="bfloat16")),
    "int4-float32-12-brgemm": ("llama", HEAD_DIM_32, 12, dict(quantization="int4", dtype="float32",
                                                             activation_dtype="model")),
    "int4-float32-12-int16": ("llama", HEAD_DIM_32, 12, dict(quantization="int4", dtype="float32",
                                                            activation_dtype="int16")),
    "qkv-bias-int8-cache": ("qwen2", HEAD_DIM_32, 3, dict(quantization="int4", dtype="float32", kv_cache_dtype="int8")),
    "window-fp8-cache": ("mistral-window", dict(HEAD_DIM_32, head_dim=32), 2,
                         dict(quantization="int4", dtype="bfloat16", kv_cache_dtype="fp8_e5m2")),
    "partial-rotary": ("phi3", dict(hidden_size=256, intermediate_size=256), 2, dict(quantization="int4", dtype="float32")),
    "dynamic-ntk-rope": ("llama-dynamic", HEAD_DIM_32, 2, dict(quantization="int4", dtype="float32")),
    "int8-activations": ("llama", HEAD_DIM_32, 3, dict(quantization="int4", dtype="float32", activation_dtype="int8")),
    "batch-invariant": ("llama", HEAD_DIM_32, 12, dict(quantization="int4", dtype="bfloat16", batch_invariant=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_stack_equals_python_layers(case, make_tiny_model_dir, tmp_path, monkeypatch):
    arch, overrides, num_prompts, engine_args = CASES[case]
    folder = str(make_tiny_model_dir(tmp_path, arch, **overrides))
    stacked, stack_steps, llm = greedy_run(monkeypatch, folder, num_prompts, stack=True, **engine_args)
    assert llm.llm_engine.runner.model.decode_stack() is not None
    layered, layer_steps, _ = greedy_run(monkeypatch, folder, num_prompts, stack=False, **engine_args)
    assert layer_steps == 0
    assert stack_steps >= 39   # every decode step of the run
    assert stacked == layered


ONE_ROW_CASES = {
    "int4-float32": ("llama", HEAD_DIM_32, dict(quantization="int4", dtype="float32")),
    "int4-bfloat16": ("llama", HEAD_DIM_32, dict(quantization="int4", dtype="bfloat16")),
    "int8-bfloat16": ("llama", HEAD_DIM_32, dict(quantization="int8", dtype="bfloat16")),
    "qkv-bias-int8-cache": ("qwen2", HEAD_DIM_32, dict(quantization="int4", dtype="float32", kv_cache_dtype="int8")),
    "window-fp8-cache": ("mistral-window", dict(HEAD_DIM_32, head_dim=32), dict(quantization="int4", dtype="bfloat16",
                                                                                  kv_cache_dtype="fp8_e5m2")),
    "partial-rotary": ("phi3", dict(hidden_size=256, intermediate_size=256), dict(quantization="int4", dtype="float32")),
}


@pytest.mark.parametrize("case", ONE_ROW_CASES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_steps_in_one_region_equal_python_layers(threads, case, make_tiny_model_dir, tmp_path, monkeypatch):
    """A one-row step's layers run in one parallel region, each thread its share of every kernel, meeting at
    barriers: bitwise the Python layers' results with 1 thread, 2, and 3 (more threads than the tiny models' kv heads,
    so a thread with no heads of attention)."""
    arch, overrides, engine_args = ONE_ROW_CASES[case]
    folder = str(make_tiny_model_dir(tmp_path, arch, **overrides))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stacked, one_row_steps, _ = greedy_run(monkeypatch, folder, 1, stack=True, event="pagedllm::decode_one_row",
                                               **engine_args)
        layered, _, _ = greedy_run(monkeypatch, folder, 1, stack=False, **engine_args)
    finally:
        torch.set_num_threads(previous)
    assert one_row_steps >= 39   # every decode step of the run
    assert stacked == layered


def test_bundled_default_equals_python_layers(monkeypatch):
    """The configuration users run (the bundled Q4_1 GGUF, all defaults): bitwise the Python layers' results."""
    stacked, stack_steps, _ = greedy_run(monkeypatch, None, 2, stack=True, max_tokens=24)
    layered, _, _ = greedy_run(monkeypatch, None, 2, stack=False, max_tokens=24)
    assert stack_steps >= 23 and stacked == layered


@pytest.mark.parametrize("arch, overrides, engine_args, reason", [
    ("llama", HEAD_DIM_32, dict(quantization="none", dtype="float32"), "not all plain quantized layers"),
    ("llama", {}, dict(quantization="int4", dtype="float32"), "rotary embedding takes the torch path"),
    ("qwen3", HEAD_DIM_32, dict(quantization="int4", dtype="float32"), "q/k or sandwich norms"),
    ("mixtral", dict(HEAD_DIM_32, head_dim=32), dict(quantization="int4", dtype="float32"), "not a dense silu MLP"),
])
def test_layers_the_stack_does_not_cover_run_in_python(arch, overrides, engine_args, reason, make_tiny_model_dir,
                                                        tmp_path, monkeypatch, caplog):
    folder = str(make_tiny_model_dir(tmp_path, arch, **overrides))
    with caplog.at_level(logging.INFO, logger="pagedllm.model.decode_stack"):
        results, steps, llm = greedy_run(monkeypatch, folder, 2, stack=True, max_tokens=8, **engine_args)
    assert steps == 0 and llm.llm_engine.runner.model.decode_stack() is None
    assert any(reason in record.getMessage() for record in caplog.records)
    assert all(len(tokens) == 8 for tokens, _ in results)


def test_steps_with_more_than_decodes_run_in_python(make_tiny_model_dir, tmp_path, monkeypatch):
    """A prefill chunk, padding rows, a cascade group or another attention backend: the Python layers."""
    folder = str(make_tiny_model_dir(tmp_path, "llama", **HEAD_DIM_32))
    _, _, llm = greedy_run(monkeypatch, folder, 1, stack=True, max_tokens=2, quantization="int4", dtype="float32")
    stack, backend = llm.llm_engine.runner.model.decode_stack(), llm.llm_engine.runner.attention_backend

    def meta(num_tokens: int, num_decodes: int, **fields) -> AttentionMetadata:
        empty = torch.zeros(0, dtype=torch.int64)
        return AttentionMetadata(torch.zeros(num_tokens, dtype=torch.int64), num_decodes,
                                 torch.zeros(num_decodes, 1, dtype=torch.int64), torch.ones(num_decodes, dtype=torch.int64),
                                 empty, empty, empty.view(0, 1), 16, **{"backend": backend, **fields})

    int16 = int16_is_faster(torch.float32)
    assert stack.path(meta(3, 3), 3) == ("int16" if int16 else "rows")
    assert stack.path(meta(64, 64), 64) == ("int16" if int16 else "brgemm")
    assert stack.path(meta(3, 2), 3) is None          # a prefill token
    assert stack.path(meta(2, 2), 3) is None          # a padding row
    assert stack.path(meta(3, 3, decode_cascade=object()), 3) is None
    assert stack.path(meta(3, 3, backend=None), 3) is None


def test_force_variable_is_checked(make_tiny_model_dir, tmp_path, monkeypatch):
    folder = str(make_tiny_model_dir(tmp_path, "llama", **HEAD_DIM_32))
    monkeypatch.setenv(FORCE_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"{FORCE_VARIABLE} must be 0 .* or 1"):
        LLM(folder, kv_cache_memory="16MiB", quantization="int4", dtype="float32")
