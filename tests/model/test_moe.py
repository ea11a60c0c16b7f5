"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers: routings that spread over
several experts and leave others unused, quantized experts (GGUF Q8_0 stacked, int8), and the sizes tensor
parallelism refuses. Greedy tokens and GGUF round trips of the float models: test_model_vs_transformers.py."""
import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from gguf_files import write_gguf
from pagedllm import LLM, SamplingParams
from pagedllm.model.config import model_config_from_hf
from pagedllm.model.linear import QuantizedLinear
from pagedllm.model.quantization import quantize
from test_model_vs_transformers import GREEDY, LOGPROB_TOLERANCE, assert_matches_reference, reference_greedy

# Each tiny MoE (conftest.TINY_ARCHS) and llama.cpp's architecture name for it.
MOE_ARCHS = {"mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe"}


def prompts_of(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=generator).tolist() for length in lengths]


def recorded_routings(model) -> list[torch.Tensor]:
    """Hooks every router of a transformers MoE; the list fills with each call's chosen experts [tokens, k]."""
    picks = []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):   # returns (logits, top-k weights, top-k experts)
            module.register_forward_hook(lambda router, args, output: picks.append(output[2]))
    return picks


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routings_hit_several_experts_and_leave_some_unused(arch, make_tiny_model_dir, tmp_path):
    """Each prompt alone, so every decode step routes one token to top_k of 8 experts (the rest unused, in
    pagedllm's step as in the reference's) and each prefill spreads its tokens over several."""
    folder = make_tiny_model_dir(tmp_path, arch)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    picks = recorded_routings(reference)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB")
    for prompt in prompts_of((2, 40), seed=4):
        assert_matches_reference(llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False), reference,
                                 [prompt])
    config = reference.config
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    distinct = [len(set(chosen.flatten().tolist())) for chosen in picks]
    assert max(distinct) > config.num_experts_per_tok, "no step spread its tokens over more than top_k experts"
    assert min(distinct) < num_experts, "no step left an expert unused"
    assert set().union(*(chosen.flatten().tolist() for chosen in picks)) == set(range(num_experts))


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_experts_run_beside_every_attention_backend(attention_backend, make_tiny_model_dir, tmp_path):
    """The experts are plain torch ops, the same under each backend (Triton's kernels interpreted on a CPU)."""
    folder = make_tiny_model_dir(tmp_path, "qwen2moe")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", attention_backend=attention_backend)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for prompt in prompts_of((5, 19), seed=6):
        completion = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        tokens, logprobs = reference_greedy(reference, prompt, params.max_tokens)
        assert completion.token_ids == tokens
        for step, token, ref_step in zip(completion.logprobs, tokens, logprobs):
            assert step[token].logprob == pytest.approx(ref_step[token].item(), abs=LOGPROB_TOLERANCE)


def q8_0_round_trip(values: np.ndarray) -> np.ndarray:
    kind = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind)


def int8_round_trip(values: np.ndarray) -> np.ndarray:
    """pagedllm's int8 groups run along each row, so a stacked [experts, rows, cols] tensor quantizes as its rows."""
    rows = torch.from_numpy(values).reshape(-1, values.shape[-1])
    return quantize(rows, 8).dequantize().reshape(values.shape).numpy()


def is_expert_weight(name: str) -> bool:
    return ".experts." in name or ".shared_expert." in name


def is_int8_weight(name: str) -> bool:
    """What quantization='int8' quantizes (loader.is_quantizable), in transformers' parameter names: every
    projection, the stacked experts, the embedding and LM head; not the norms, routers or shared-expert gate."""
    return (name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj"))
            or name in ("model.embed_tokens.weight", "lm_head.weight"))


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("source", ["gguf-Q8_0", "int8"])
def test_quantized_experts_match_transformers_on_the_same_weights(source, arch, make_tiny_model_dir,
                                                                 bundled_gguf_path, tmp_path):
    """The experts stay quantized (Q8_0 blocks read from GGUF's stacked tensors, or int8 from the float folder)
    and run through the quantized kernels. Both formats hold value = scale * q with a float16 scale and an
    8-bit q: exact in float32, so transformers on the dequantized weights computes with the very numbers our
    kernels use, and what is left is float32 summation order: the float tests' 1e-4 bound holds unchanged. The
    activations stay float32 (activation_dtype model: AVX2 builds would otherwise round many rows to int16, whose
    error test_quantization bounds)."""
    folder = make_tiny_model_dir(tmp_path, arch)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if source == "int8":
        llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization="int8", activation_dtype="model")
        round_trip, quantized = int8_round_trip, is_int8_weight
    else:
        path = tmp_path / f"{arch}-q8_0.gguf"
        write_gguf(path, MOE_ARCHS[arch], reference.config, reference.state_dict(), tokenizer_from=bundled_gguf_path,
                   expert_type=gguf.GGMLQuantizationType.Q8_0)
        llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", activation_dtype="model")
        round_trip, quantized = q8_0_round_trip, is_expert_weight
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if quantized(name):
                param.copy_(torch.from_numpy(round_trip(param.numpy())))
    sparse = next(layer.mlp for layer in llm.llm_engine.runner.model.layers if hasattr(layer.mlp, "experts"))
    expert = sparse.experts[0].gate_up_proj
    assert isinstance(expert, QuantizedLinear) and expert.format == source.removeprefix("gguf-")
    prompts = prompts_of((3, 21, 64), seed=5)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, reference, prompts)


@pytest.mark.parametrize("moe_intermediate_size, tp_size, quantization, message", [
    (34, 4, "none", r"tensor_parallel_size must divide moe_intermediate_size \(34\), got 4"),
    (48, 2, "int8", r"moe_intermediate_size \(48\) / tensor_parallel_size \(2\) must be a multiple of 32"),
])
def test_expert_sizes_that_do_not_split_are_refused(moe_intermediate_size, tp_size, quantization, message,
                                                    make_tiny_model_dir, tmp_path):
    folder = make_tiny_model_dir(tmp_path, "qwen2moe", moe_intermediate_size=moe_intermediate_size)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", quantization=quantization,
            tensor_parallel_size=tp_size)


def test_batch_invariance_is_refused_for_the_float_routers(make_tiny_model_dir, tmp_path):
    folder = make_tiny_model_dir(tmp_path, "mixtral")
    with pytest.raises(ValueError, match=r"batch_invariant=True .* layers\.0\.mlp\.gate holds float weights"):
        LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", quantization="int8", batch_invariant=True)


def test_qwen2_moe_windows_follow_transformers_when_the_config_lists_no_layer_types():
    """Older Qwen2-MoE configs say use_sliding_window and max_window_layers only; transformers derives the
    pattern (every other layer below max_window_layers), and so must pagedllm."""
    config = Qwen2MoeConfig(num_hidden_layers=6, use_sliding_window=True, sliding_window=32, max_window_layers=4)
    saved = {**config.to_dict(), "architectures": ["Qwen2MoeForCausalLM"]}
    del saved["layer_types"]
    windows = model_config_from_hf(saved, None).layer_windows
    assert windows == tuple(32 if kind == "sliding_attention" else None for kind in config.layer_types)
    assert windows == (32, None, 32, None, None, None)


def test_qwen3_moe_windows_only_with_use_sliding_window():
    """transformers drops a Qwen3-MoE config's sliding_window unless use_sliding_window is set."""
    saved = {**Qwen3MoeConfig(num_hidden_layers=2).to_dict(), "architectures": ["Qwen3MoeForCausalLM"],
             "sliding_window": 4096}
    assert model_config_from_hf(saved, None).layer_windows == (None, None)
    assert model_config_from_hf({**saved, "use_sliding_window": True}, None).layer_windows == (4096, 4096)
