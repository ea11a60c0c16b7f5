"""Greedy tokens and per-step logprobs against transformers' own implementation (float32)."""
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from gguf_files import gguf_round_trip, write_gguf
from pagedllm import LLM, SamplingParams
from pagedllm.model.attention.cpu import CpuAttentionBackend
from pagedllm.model.quantization import quantize

MAX_NEW_TOKENS = 64
LOGPROB_TOLERANCE = 1e-4
TOP_LOGPROBS = 3


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int):
    """transformers' generate, one prompt at a time, EOS not stopping; returns tokens and step logprobs."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=0, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return tokens, logprobs


def assert_chosen_tokens_match(completion, ref_tokens, ref_logprobs):
    """The completion's tokens are transformers' greedy ones, and their logprobs within tolerance."""
    assert completion.token_ids == ref_tokens
    ours = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, ref_tokens)])
    theirs = ref_logprobs[torch.arange(len(ref_tokens)), torch.tensor(ref_tokens)]
    torch.testing.assert_close(ours, theirs, atol=LOGPROB_TOLERANCE, rtol=0)


def assert_matches_reference(llm_outputs, reference_model, prompts):
    for prompt_ids, output in zip(prompts, llm_outputs):
        ref_tokens, ref_logprobs = reference_greedy(reference_model, prompt_ids, MAX_NEW_TOKENS)
        completion = output.outputs[0]
        assert_chosen_tokens_match(completion, ref_tokens, ref_logprobs)
        for step, ref_step in zip(completion.logprobs, ref_logprobs):
            for token_id, logprob in step.items():
                assert logprob.logprob == pytest.approx(ref_step[token_id].item(), abs=LOGPROB_TOLERANCE)
            assert set(step) == set(ref_step.topk(TOP_LOGPROBS).indices.tolist()) or near_tie_at_the_cut(ref_step)


def near_tie_at_the_cut(ref_step: torch.Tensor) -> bool:
    """The reference's k-th and (k+1)-th log-probabilities within twice the tolerance: either may be in our top k."""
    kth, next_one = ref_step.topk(TOP_LOGPROBS + 1).values[-2:].tolist()
    return kth - next_one <= 2 * LOGPROB_TOLERANCE


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)


@pytest.fixture(scope="module")
def bundled_llm():
    return LLM(dtype="float32", quantization="none", kv_cache_memory="256MiB")   # the float path, exact


TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about paged memory in operating systems.",
    "def fibonacci(n):\n    ",
    "List three prime numbers and explain why each one is prime, step by step.",
    "Translate to French: The cat sat on the mat because it was warm and the sun was shining brightly.",
    "PagedAttention stores the key-value cache in fixed-size blocks. " * 6,
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about "
    "mathematics, astronomy, poetry and the history of forgotten kingdoms. Every morning she",
]


def test_bundled_model_matches_transformers_greedy(bundled_llm, bundled_reference):
    tokenizer = bundled_llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts should differ in length"
    outputs = bundled_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, bundled_reference, prompts)


def test_gguf_and_safetensors_give_the_same_logits(bundled_llm, bundled_reference, hf_tokenizer_dir,
                                                    tmp_path_factory):
    # transformers' own dequantized weights, written as a plain safetensors checkpoint
    # (its save_pretrained refuses GGUF-quantized models).
    folder = tmp_path_factory.mktemp("smollm2-safetensors")
    config = bundled_reference.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(bundled_reference).__name__]
    (folder / "config.json").write_text(json.dumps(config))
    state = {name: tensor.contiguous() for name, tensor in bundled_reference.state_dict().items()
             if not (config.get("tie_word_embeddings") and name == "lm_head.weight")}
    save_file(state, folder / "model.safetensors")
    for file in hf_tokenizer_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    from_folder = LLM(str(folder), dtype="float32", kv_cache_memory="64MiB")
    prompt = {"prompt_token_ids": bundled_llm.get_tokenizer().encode(TEXTS[5])}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    a = bundled_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = from_folder.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for step_a, step_b in zip(a.logprobs, b.logprobs):
        assert step_a.keys() == step_b.keys()
        for token_id in step_a:
            assert step_a[token_id].logprob == pytest.approx(step_b[token_id].logprob, abs=1e-4)


TINY_ARCHS = ["llama3", "mistral", "qwen2", "qwen3", "qwen2-yarn", "llama-dynamic", "phi3", "phi3-longrope",
              "mistral-window", "qwen2-window", "gemma2", "gemma3", "mixtral", "mixtral-window", "qwen2moe",
              "qwen2moe-window", "qwen3moe", "qwen3moe-window"]
PROMPT_LENGTHS = (1, 5, 17, 33, 70, 130, 9, 48)
# Past the original context (64 for yarn and dynamic NTK, 128 for longrope) at the prompt or while
# decoding; longrope's prompts either start past it or stay within it to the last token (transformers
# recomputes a sequence that crosses it during decoding with the long factors; pagedllm keeps its
# earlier K/V, see docs/models.md).
PROMPT_LENGTHS_BY_ARCH = {"phi3-longrope": (1, 5, 17, 33, 129, 200, 9, 48)}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_random_models_match_transformers(arch, make_tiny_model_dir, tmp_path):
    folder = make_tiny_model_dir(tmp_path, arch)
    vocab = AutoModelForCausalLM.from_pretrained(folder).config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (length,), generator=generator).tolist()
               for length in PROMPT_LENGTHS_BY_ARCH.get(arch, PROMPT_LENGTHS)]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", block_size=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        # A fresh reference per prompt: transformers' dynamic NTK keeps the longest length it has seen.
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert_matches_reference([output], reference, [prompt])


@pytest.fixture(scope="module")
def tiny_llama_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama3")


def test_same_tokens_alone_together_and_for_every_block_size(tiny_llama_dir):
    generator = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=generator).tolist()}
               for n in (3, 20, 41, 64, 100)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = {}
    for block_size in (8, 16, 32):
        llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="8MiB", block_size=block_size)
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert together == alone
        results[block_size] = together
        pool = llm.llm_engine.kv_manager.pool
        assert pool.num_free_blocks == pool.num_blocks
    assert results[8] == results[16] == results[32]


def test_block_tables_hold_ceil_of_length_while_running(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8,
              max_num_batched_tokens=64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, length in enumerate((5, 31, 90)):
        engine.add_request(str(i), {"prompt_token_ids": list(range(10, 10 + length))}, params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            table = engine.kv_manager.get_block_table(request.request_id)
            assert len(table) == math.ceil(request.num_computed_tokens / 8)
            checked += 1
    assert checked > 0
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


@pytest.mark.parametrize("arch, gguf_arch", [("phi3", "phi3"), ("phi3-longrope", "phi3"), ("qwen2-yarn", "qwen2"),
                                            ("gemma2", "gemma2"), ("gemma3", "gemma3"),
                                            ("mixtral", "llama"), ("qwen2moe", "qwen2moe"), ("qwen3moe", "qwen3moe")])
def test_gguf_written_from_the_folder_gives_its_logits(arch, gguf_arch, make_tiny_model_dir, bundled_gguf_path,
                                                       tmp_path):
    """llama.cpp's layout (Phi-3's fused qkv and gate_up, longrope factors as tensors, yarn keys, Gemma's norms
    with the +1 added, its soft-caps, window pattern and local rope base) read back
    to the same model: greedy tokens and logprobs equal to the safetensors folder's, past the original context."""
    folder = make_tiny_model_dir(tmp_path, arch)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, gguf_arch, reference.config, reference.state_dict(), tokenizer_from=bundled_gguf_path)
    generator = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (length,), generator=generator).tolist()}
               for length in (7, 150)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    runs = [LLM(str(source), dtype="float32", kv_cache_memory="16MiB").generate(prompts, params, use_tqdm=False)
            for source in (folder, path)]
    for from_folder, from_gguf in zip(*runs):
        a, b = from_folder.outputs[0], from_gguf.outputs[0]
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys()
            for token_id in step_a:
                assert step_a[token_id].logprob == pytest.approx(step_b[token_id].logprob, abs=1e-5)


@pytest.mark.parametrize("arch, type_name", [("gemma2", "Q4_0"), ("gemma3", "Q8_0")])
def test_quantized_gguf_runs_its_quantized_weights_as_transformers_does(arch, type_name, make_tiny_model_dir,
                                                                       bundled_gguf_path, tmp_path):
    """A GGUF whose matrices (embedding and projections) gguf quantized runs them through the quantized
    kernels with float32 activations (activation_dtype model: AVX2 builds would otherwise round many rows to int16,
    whose error test_quantization bounds), and gives transformers' greedy tokens and logprobs on the same weights as
    gguf dequantizes them."""
    folder = make_tiny_model_dir(tmp_path, arch)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = tmp_path / f"{arch}-{type_name}.gguf"
    write_gguf(path, arch, reference.config, reference.state_dict(), tokenizer_from=bundled_gguf_path,
               quantized=type_name)
    with torch.no_grad():
        for name, weight in reference.named_parameters():
            if weight.dim() == 2:
                weight.copy_(gguf_round_trip(weight, type_name))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (9, 70)]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", activation_dtype="model")
    model = llm.llm_engine.runner.model
    assert model.embed_tokens.format == model.layers[0].mlp.gate_up_proj.format == type_name
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, reference, prompts)


def test_int4_gemma_folder_runs_its_quantized_weights_as_transformers_does(make_tiny_model_dir, tmp_path):
    """quantization="int4" on a Gemma 2 folder: projections at 4 bits, the (tied) embedding at 8, quantized as
    they are read (norms first read as 1 + w, left float), against transformers on the dequantized weights."""
    folder = make_tiny_model_dir(tmp_path, "gemma2")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in reference.named_parameters():
            if weight.dim() == 2:
                weight.copy_(quantize(weight, 8 if "embed_tokens" in name else 4).dequantize())
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (9, 70)]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization="int4")
    model = llm.llm_engine.runner.model
    assert (model.embed_tokens.format, model.layers[0].qkv_proj.format) == ("int8", "int4")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, reference, prompts)


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
def test_sliding_window_holds_through_prefix_hits_chunks_speculation_and_preemption(
        attention_backend, make_tiny_model_dir, tmp_path):
    """Mistral with a 20-token window: prompts sharing a 48-token head (prefix-cache hits on blocks partly
    outside the window), prefill in chunks of 24, n-gram speculation (rollback over released blocks), and a
    pool of 13 blocks of 8 (preemption) still give transformers' greedy tokens and logprobs."""
    folder = make_tiny_model_dir(tmp_path, "mistral-window")
    generator = torch.Generator().manual_seed(3)
    head = torch.randint(3, 256, (48,), generator=generator).tolist()
    prompts = [head + torch.randint(3, 256, (n,), generator=generator).tolist() for n in (1, 9, 30)]
    prompts.append(head[:8] * 6)   # repeats: n-gram proposals get accepted
    llm = LLM(str(folder), dtype="float32", block_size=8, kv_cache_memory="52KiB", max_num_batched_tokens=24,
              max_num_seqs=4, attention_backend=attention_backend,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    engine = llm.llm_engine
    assert engine.kv_manager.sliding_window == 20
    assert engine.kv_manager.pool.num_blocks == 13
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_manager.prefix_cache_hits > 0
    assert_greedy_matches(folder, prompts, outputs, 24)
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


def assert_greedy_matches(folder, prompts, outputs, max_new_tokens):
    """Each output's tokens equal to transformers' greedy ones, and the chosen tokens' logprobs within tolerance."""
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        assert_chosen_tokens_match(output.outputs[0], *reference_greedy(reference, prompt, max_new_tokens))


@pytest.fixture
def cascade_calls(monkeypatch):
    """How many times the cascade kernel served (wrapped, still run)."""
    calls = []
    kernel = CpuAttentionBackend._cascade

    def counted(*args):
        calls.append(args[-1])   # the layer it attended for
        return kernel(*args)
    monkeypatch.setattr(CpuAttentionBackend, "_cascade", counted)
    return calls


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("attention_backend, speculation", [("cpu", "ngram"), ("cpu", None), ("torch", "ngram")])
def test_gemma_windows_hold_through_prefix_hits_chunks_cascade_speculation_and_preemption(
        arch, attention_backend, speculation, make_tiny_model_dir, tmp_path, cascade_calls):
    """Gemma's sliding layers (window 20) beside a full-attention one: prompts sharing a cached 136-token
    head (prefix-cache hits on blocks outside the window), prefill in chunks of 24, a pool of 32 blocks of 8
    (preemption), and n-gram speculation (rollback) or, without it on the cpu backend, cascade groups (in
    the full layer only: windowed layers run the plain kernels) still give transformers' greedy tokens and
    logprobs. No block is released early: the full layer needs them all."""
    folder = make_tiny_model_dir(tmp_path, arch)
    generator = torch.Generator().manual_seed(4)
    head = torch.randint(3, 256, (136,), generator=generator).tolist()
    prompts = [head + torch.randint(3, 256, (n,), generator=generator).tolist() for n in (1, 9, 30)]
    prompts.append(head + head[:8] * 3)   # repeats: n-gram proposals get accepted
    # 3 layers x (K, V) x 2 kv heads x 16 x 8 slots x 4 bytes = 6 KiB per block.
    llm = LLM(str(folder), dtype="float32", block_size=8, kv_cache_memory="192KiB", max_num_batched_tokens=24,
              max_num_seqs=4, attention_backend=attention_backend, enable_cascade_attention=True,
              speculative_config=speculation and {"method": speculation, "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3})
    engine = llm.llm_engine
    assert engine.kv_manager.sliding_window is None
    assert engine.kv_manager.pool.num_blocks == 32
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1), use_tqdm=False)   # caches the head
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_manager.prefix_cache_hits >= len(prompts) * len(head)
    if attention_backend == "cpu" and speculation is None:
        assert cascade_calls and all(layer.sliding_window is None for layer in cascade_calls)
    assert_greedy_matches(folder, prompts, outputs, 24)
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_triton_refuses_gemma_2_soft_capping_at_start_up(make_tiny_model_dir, tmp_path):
    """Gemma 2's attention soft-cap applies to every layer, windowed or not (and a window wider than the
    context is no window): the Triton kernels cannot cap, so it is refused before a step runs."""
    folder = make_tiny_model_dir(tmp_path, "gemma2", sliding_window=4096)
    with pytest.raises(ValueError, match=r"'triton' cannot run this model's attention logit soft-capping "
                                         r"\(layers \[0, 1, 2\]\)"):
        LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", attention_backend="triton")


@pytest.mark.triton
@pytest.mark.parametrize("attention_backend", ["cpu", "triton"])
def test_gemma3_sliding_layers_keep_their_rope_where_the_window_covers_the_context(attention_backend,
                                                                                   make_tiny_model_dir, tmp_path):
    """A window past max_model_len is full attention (no window for any kernel, so Triton may serve), yet the
    sliding layers still rotate at their local base."""
    if attention_backend == "triton":
        pytest.importorskip("pagedllm.model.attention.triton_kernels", reason="triton is not installed")
    folder = make_tiny_model_dir(tmp_path, "gemma3", sliding_window=4096)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (5, 40)]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", attention_backend=attention_backend)
    model = llm.llm_engine.runner.model
    assert all(layer.sliding_window is None for layer in model.attention_layers)
    assert [layer.local_rope for layer in model.layers] == [True, False, True]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    assert_greedy_matches(folder, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False), 12)
