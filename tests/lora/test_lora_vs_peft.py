"""Adapters served over the tiny random Llama and Qwen2 against transformers + peft (float32): greedy tokens identical,
every step's logprobs within 1e-4.

Tolerance: both sides compute in float32, and differ only in summation order (our fused projections, grouped LoRA
matmuls and scaling folded into B against peft's separate modules): a few float32 ulps per layer, about 3e-6 in the
logprobs measured here. 1e-4 is the float32 tolerance the model tests use against transformers, some 30x above what
is seen; a wrong adapter (scaling dropped, a part's columns misplaced) moves logprobs by O(0.1-1).
"""
import pytest
import torch

from gguf_files import gguf_round_trip, write_gguf
from tests.lora.peft_adapters import ATTENTION, make_adapter, reference_greedy, reference_model
from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest
from pagedllm.model.quantization import quantize

LOGPROB_TOLERANCE = 1e-4
MAX_NEW_TOKENS = 24
TOP_LOGPROBS = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
PROMPT_LENGTHS = (1, 17, 40)


def random_prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def assert_matches_peft(outputs, reference, prompts) -> None:
    for prompt, output in zip(prompts, outputs):
        ref_tokens, ref_logprobs = reference_greedy(reference, prompt, MAX_NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        for step, ref_step in zip(completion.logprobs, ref_logprobs):
            for token_id, logprob in step.items():
                assert logprob.logprob == pytest.approx(ref_step[token_id].item(), abs=LOGPROB_TOLERANCE)


CASES = [  # arch, rank, targets, rsLoRA
    ("llama3", 8, ATTENTION, False),
    ("llama3", 64, "all-linear", False),
    ("qwen2", 8, "all-linear", True),
    ("qwen2", 64, ATTENTION, False),
    ("llama3", 16, ["q_proj", "v_proj", "up_proj"], False),   # parts of the fused qkv and gate_up layers only
]


@pytest.mark.parametrize("arch, rank, targets, use_rslora", CASES)
def test_adapter_matches_peft(arch, rank, targets, use_rslora, make_tiny_model_dir, tmp_path):
    base = make_tiny_model_dir(tmp_path, arch)
    adapter = make_adapter(base, tmp_path / "adapter", rank=rank, targets=targets, use_rslora=use_rslora)
    prompts = random_prompts(rank)
    llm = LLM(str(base), dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("adapter", 1, str(adapter)))
    assert_matches_peft(outputs, reference_model(base, adapter), prompts)
    # The base model still runs unchanged in the same engine.
    base_outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_peft(base_outputs, reference_model(base, None), prompts)


def test_adapter_over_an_int8_base_matches_peft_on_the_dequantized_weights(make_tiny_model_dir, tmp_path):
    """quantization="int8": the base runs its quantized kernels and the adapter's update is added to their output;
    the reference is peft over transformers holding the weights as int8 dequantizes them (the same numbers the
    kernels multiply, with float32 activations (activation_dtype model), so the float32 tolerance holds)."""
    base = make_tiny_model_dir(tmp_path, "llama3")
    adapter = make_adapter(base, tmp_path / "adapter", rank=16, targets="all-linear")
    reference = reference_model(base, adapter)
    with torch.no_grad():
        for name, weight in reference.named_parameters():
            if weight.dim() == 2 and "lora_" not in name:
                weight.copy_(quantize(weight, 8).dequantize())
    prompts = random_prompts(7)
    llm = LLM(str(base), dtype="float32", kv_cache_memory="16MiB", quantization="int8", activation_dtype="model",
              enable_lora=True)
    assert llm.llm_engine.runner.model.layers[0].qkv_proj.base.format == "int8"
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("adapter", 1, str(adapter)))
    assert_matches_peft(outputs, reference, prompts)


def test_adapter_over_a_q4_0_gguf_base_matches_peft_on_the_dequantized_weights(make_tiny_model_dir, bundled_gguf_path,
                                                                               tmp_path):
    """The common CPU case: a GGUF whose projections are Q4_0 (as the bundled model's Q4_1) stays quantized, its
    kernels run (float32 activations: activation_dtype model), and the adapter's update is added; the reference is
    peft over the weights as gguf dequantizes them."""
    folder = make_tiny_model_dir(tmp_path, "llama3", rope_scaling=None)   # the test's GGUF writer has no llama3 rope
    adapter = make_adapter(folder, tmp_path / "adapter", rank=8, targets="all-linear")
    state = reference_model(folder, None).state_dict()
    path = tmp_path / "tiny-Q4_0.gguf"
    write_gguf(path, "llama", reference_model(folder, None).config, state, tokenizer_from=bundled_gguf_path,
               quantized="Q4_0")
    reference = reference_model(folder, adapter)
    with torch.no_grad():
        for name, weight in reference.named_parameters():
            if weight.dim() == 2 and "lora_" not in name:
                weight.copy_(gguf_round_trip(weight, "Q4_0"))
    prompts = random_prompts(11)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", activation_dtype="model", enable_lora=True)
    assert llm.llm_engine.runner.model.layers[0].mlp.gate_up_proj.base.format == "Q4_0"
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("adapter", 1, str(adapter)))
    assert_matches_peft(outputs, reference, prompts)
