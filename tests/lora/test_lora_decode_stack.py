"""Adapters on the compiled decode stack (pagedllm/model/decode_stack.py) against the Python layers.

The stack runs each adapter-wrapped projection's `lora_sgmv` right after its matmul, as LoRALinear does, on the same
inputs (a one-row step runs all its layers, adapters included, in one parallel region, `pagedllm::decode_one_row`):
every token and top-5 logprob of one adapter's request and of a mixed batch (three adapters of different ranks and
targets, and base rows) must be bitwise those of PAGEDLLM_DECODE_STACK=0, with 1, 2 and 3 threads (the threads'
shares, each thread's own h and the barriers; 3 threads on 2 cores split the tiles unevenly), and torch.profiler's
counts show the stack served every decode step, through the one-row region where a step has one row. The Python
layers' adapters are held to peft by test_lora_vs_peft.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.lora.peft_adapters import three_adapter_requests
from pagedllm import LLM, SamplingParams
from pagedllm.model.attention.metadata import MAX_DECODE_ROW_TOKENS
from pagedllm.model.decode_stack import FORCE_VARIABLE

pytestmark = pytest.mark.kernels

HEAD_DIM_32 = dict(hidden_size=128, intermediate_size=256)   # 4 heads of 32: the rope kernel's smallest head
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def base(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("stack-base"), "llama", **HEAD_DIM_32)


@pytest.fixture(scope="module")
def loras(base, tmp_path_factory):
    return three_adapter_requests(base, tmp_path_factory.mktemp("stack-adapters"))


def greedy_run(monkeypatch, base, lora_requests, stack: bool, **engine_args):
    """Each prompt's tokens and top-5 logprobs, and torch.profiler's event counts by name."""
    monkeypatch.setenv(FORCE_VARIABLE, "1" if stack else "0")
    llm = LLM(str(base), kv_cache_memory="16MiB", enable_prefix_caching=False, enable_lora=True, max_loras=3,
              max_lora_rank=16, **engine_args)
    # Prompts longer than a row that attends as decodes: their prefill runs the Python layers in either run.
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 250 + 3 for j in range(MAX_DECODE_ROW_TOKENS + 1 + i)]}
               for i in range(len(lora_requests))]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_requests)
    counts = {event.key: event.count for event in profiler.key_averages()}
    results = [(list(o.outputs[0].token_ids),
                [sorted((token, entry.logprob) for token, entry in position.items()) for position in o.outputs[0].logprobs])
               for o in outputs]
    return results, counts, llm


@pytest.mark.parametrize("engine_args", [dict(quantization="int4", dtype="float32"),
                                         dict(quantization="int4", dtype="bfloat16"),
                                         dict(quantization="int8", dtype="bfloat16")],
                         ids=["int4-float32", "int4-bfloat16", "int8-bfloat16"])
@pytest.mark.parametrize("mix", ["one-adapter", "three-adapters-and-base"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_stack_with_adapters_equals_python_layers(threads, mix, engine_args, base, loras, monkeypatch):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_stack_with_adapters(mix, engine_args, base, loras, monkeypatch)
    finally:
        torch.set_num_threads(previous)


def check_stack_with_adapters(mix, engine_args, base, loras, monkeypatch):
    lora_requests = [loras[0]] if mix == "one-adapter" else [loras[0], None, loras[1], loras[2], loras[0], None]
    stacked, stack_counts, llm = greedy_run(monkeypatch, base, lora_requests, stack=True, **engine_args)
    assert llm.llm_engine.runner.model.decode_stack() is not None
    layered, layer_counts, _ = greedy_run(monkeypatch, base, lora_requests, stack=False, **engine_args)
    assert layer_counts.get("pagedllm::decode_layers", 0) == 0
    stack_steps = stack_counts.get("pagedllm::decode_layers", 0)
    assert stack_steps >= MAX_TOKENS - 1   # every decode step of the run
    # One row: every step's layers in one region; several rows: none.
    one_row_regions = stack_counts.get("pagedllm::decode_one_row", 0)
    assert one_row_regions == (stack_steps if mix == "one-adapter" else 0)
    assert stacked == layered
    # The adapters acted: an adapter's request does not give the base's tokens for the same prompt.
    base_alone, _, _ = greedy_run(monkeypatch, base, [None] * len(lora_requests), stack=True, **engine_args)
    for lora, ours, theirs in zip(lora_requests, stacked, base_alone):
        assert (ours == theirs) == (lora is None)
