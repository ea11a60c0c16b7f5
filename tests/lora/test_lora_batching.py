"""Mixed batches: three adapters and the base in one step, each request's tokens equal to its run alone; also under
forced preemption, with n=2, beam search, n-gram speculation and structured outputs, and through AsyncLLM."""
import asyncio

import pytest
import torch

from tests.lora.peft_adapters import three_adapter_requests
from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.lora.request import LoRARequest
from pagedllm.structured_output.params import StructuredOutputsParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def base(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-base"), "qwen2")


@pytest.fixture(scope="module")
def loras(base, tmp_path_factory):
    return three_adapter_requests(base, tmp_path_factory.mktemp("adapters"))


def prompts(count: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 256, (int(length),), generator=generator).tolist()}
            for length in torch.randint(4, 60, (count,), generator=generator)]


def mixed(loras, count: int) -> list[LoRARequest | None]:
    """Adapters 1, 2, 3 and the base in turn."""
    return [(loras + [None])[index % 4] for index in range(count)]


def token_ids(outputs) -> list[list[list[int]]]:
    return [[completion.token_ids for completion in output.outputs] for output in outputs]


def run_alone(llm, batch, params, lora_requests):
    return [llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0] for prompt, lora in zip(batch, lora_requests)]


def test_three_adapters_and_the_base_in_one_step_each_as_alone(base, loras):
    llm = LLM(str(base), dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=3)
    steps = []
    llm.llm_engine.step_listeners.append(steps.append)
    batch, lora_requests = prompts(12), mixed(loras, 12)
    together = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=lora_requests)
    assert max(step.num_loras for step in steps) == 3   # the three adapters did share steps
    assert token_ids(together) == token_ids(run_alone(llm, batch, GREEDY, lora_requests))
    # Each adapter's tokens differ from the base's: the adapters did act.
    base_alone = token_ids(run_alone(llm, batch[:3], GREEDY, [None] * 3))
    assert all(ours != theirs for ours, theirs in zip(token_ids(together[:3]), base_alone))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_under_forced_preemption_each_as_alone(preemption_mode, base, loras):
    # 12 blocks of 16 tokens: the 12 requests (up to 76 tokens each) cannot all hold their KV at once.
    llm = LLM(str(base), dtype="float32", kv_cache_memory=12 * 2 * 2 * 16 * 2 * 16 * 4, block_size=16,
              enable_lora=True, max_loras=3, preemption_mode=preemption_mode)
    assert llm.llm_engine.kv_manager.pool.num_blocks == 12
    batch, lora_requests = prompts(12, seed=1), mixed(loras, 12)
    together = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=lora_requests)
    assert llm.stats().num_preemptions > 0
    assert token_ids(together) == token_ids(run_alone(llm, batch, GREEDY, lora_requests))


def test_parallel_samples_beam_search_and_ngram_speculation_per_adapter(base, loras):
    llm = LLM(str(base), dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=3,
              speculative_config=NGRAM)
    plain = LLM(str(base), dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=3)
    batch, lora_requests = prompts(8, seed=2), mixed(loras, 8)
    sampled = SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    assert token_ids(plain.generate(batch, sampled, use_tqdm=False, lora_request=lora_requests)) == token_ids(
        run_alone(plain, batch, sampled, lora_requests))
    # n-gram speculation: the verification rows run with the request's adapter, so greedy tokens are unchanged.
    repeating = [{"prompt_token_ids": ([5, 6, 7, 8, 9] * 6)[:length]} for length in (13, 21, 30, 17)]
    speculated = llm.generate(repeating, GREEDY, use_tqdm=False, lora_request=mixed(loras, 4))
    assert llm.stats().spec_decoding.num_accepted_tokens > 0
    assert token_ids(speculated) == token_ids(run_alone(plain, repeating, GREEDY, mixed(loras, 4)))
    beams = BeamSearchParams(beam_width=2, max_tokens=8)
    together = plain.beam_search(batch[:4], beams, lora_request=mixed(loras, 4))
    alone = [plain.beam_search([prompt], beams, lora_request=lora)[0] for prompt, lora in zip(batch[:4], mixed(loras, 4))]
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in alone]


def test_structured_outputs_per_adapter(base, loras):
    llm = LLM(str(base), dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=3)
    choices = ["alpha", "beta", "gamma"]
    params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=choices))
    batch, lora_requests = prompts(4, seed=3), mixed(loras, 4)
    together = llm.generate(batch, params, use_tqdm=False, lora_request=lora_requests)
    assert all(output.outputs[0].text in choices for output in together)
    assert token_ids(together) == token_ids(run_alone(llm, batch, params, lora_requests))


def test_async_llm_loads_uses_lists_and_removes_adapters(base, loras):
    async def scenario():
        llm = AsyncLLM.from_config(EngineConfig(model=str(base), dtype="float32", kv_cache_memory="8MiB",
                                                enable_lora=True, max_loras=2, max_cpu_loras=3))
        try:
            assert await llm.add_lora(loras[0])
            assert await llm.list_loras() == {1}
            outputs = [output async for output in llm.generate(prompts(1)[0], GREEDY, "r1", lora_request=loras[1])]
            assert await llm.list_loras() == {1, 2}   # loaded on first use
            assert await llm.remove_lora(2) and await llm.list_loras() == {1}
            return outputs[-1].outputs[0].token_ids
        finally:
            await llm.shutdown()
    tokens = asyncio.run(scenario())
    offline = LLM(str(base), dtype="float32", kv_cache_memory="8MiB", enable_lora=True)
    assert tokens == offline.generate(prompts(1)[0], GREEDY, use_tqdm=False, lora_request=loras[1])[0].outputs[0].token_ids
