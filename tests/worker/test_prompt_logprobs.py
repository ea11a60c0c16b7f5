"""prompt_logprobs against transformers' log-softmax over the prompt (float32), however the prompt is prefilled."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

TOLERANCE = 1e-4
NUM_TOP = 3


@pytest.fixture(scope="module")
def tiny_llama_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("prompt-logprobs"), "llama")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """prompt token ids -> transformers' float32 log-softmax, [len - 1, vocab]: row j scores token j + 1."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)

    def log_softmax(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[:-1]
    return log_softmax


def make_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=generator).tolist() for length in lengths]


def assert_matches_reference(prompt: list[int], prompt_logprobs, reference, num_top: int) -> None:
    expected = reference(prompt)
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry, row = prompt_logprobs[position], expected[position - 1]
        token = prompt[position]
        assert abs(entry[token].logprob - row[token].item()) < TOLERANCE, (position, entry[token], row[token])
        # The rank counts the tokens more likely than it; near-ties within the tolerance may go either way.
        surely_above = int((row > row[token] + TOLERANCE).sum())
        maybe_above = int((row > row[token] - TOLERANCE).sum()) - 1
        assert surely_above + 1 <= entry[token].rank <= maybe_above + 1
        top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        assert len(top) == num_top
        assert torch.allclose(torch.tensor([lp.logprob for lp in top]), row.topk(num_top).values, atol=TOLERANCE)
        for token_id, logprob in entry.items():
            assert abs(logprob.logprob - row[token_id].item()) < TOLERANCE
        assert set(entry) <= {token, *(i for i, lp in entry.items() if lp.rank <= num_top)}


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-prefill", "whole-prefill"])
def test_prompt_logprobs_equal_transformers(tiny_llama_dir, reference, chunked):
    budget = 16 if chunked else None   # 16 tokens a step: the 50-token prompt takes four chunks
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8,
              enable_chunked_prefill=chunked, max_num_batched_tokens=budget, max_model_len=128)
    step_tokens = []
    llm.llm_engine.step_listeners.append(lambda stats: step_tokens.append(stats.num_tokens))
    prompts = make_prompts([5, 37, 50])
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=NUM_TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert_matches_reference(prompt, output.prompt_logprobs, reference, NUM_TOP)
    assert (max(step_tokens) <= 16) == chunked


def test_a_warm_prefix_cache_is_recomputed_for_prompt_logprobs(tiny_llama_dir, reference):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8, max_model_len=128)
    kv = llm.llm_engine.kv_manager
    prompt = {"prompt_token_ids": make_prompts([40], seed=1)[0]}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)   # caches its 4 full blocks
    hits = kv.prefix_cache_hits
    output = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert kv.prefix_cache_hits == hits   # the cached blocks were not taken
    assert_matches_reference(prompt["prompt_token_ids"], output.prompt_logprobs, reference, 1)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert kv.prefix_cache_hits == hits + 32   # while a request without them still hits the warm cache


def test_mixed_batch_parallel_samples_and_top_zero(tiny_llama_dir, reference):
    """Rows asking for prompt logprobs next to rows that do not; n > 1 gets them once, for its prompt;
    prompt_logprobs=0 gives each prompt token's own logprob only."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8, max_model_len=128,
              max_num_batched_tokens=32)
    prompts = make_prompts([30, 20, 12], seed=2)
    params = [SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=4),
              SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outputs[0].outputs) == 2
    assert_matches_reference(prompts[0], outputs[0].prompt_logprobs, reference, 2)
    assert outputs[1].prompt_logprobs is None
    assert all(len(entry) == 1 for entry in outputs[2].prompt_logprobs[1:])
    assert_matches_reference(prompts[2], outputs[2].prompt_logprobs, reference, 0)
    alone = llm.generate({"prompt_token_ids": prompts[1]}, params[1], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids   # the extra logits rows change nothing


def test_preempted_requests_keep_their_prompt_logprobs(tiny_llama_dir, reference):
    """A KV cache of 12 blocks of 8 tokens for four requests that each grow to 48 tokens: requests are
    preempted and recompute their prompts, and their prompt logprobs stay whole and right."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=12 * 4096, block_size=8, max_model_len=64)
    assert llm.llm_engine.kv_manager.pool.num_blocks == 12
    prompts = make_prompts([24, 24, 24, 24], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert_matches_reference(prompt, output.prompt_logprobs, reference, 1)
