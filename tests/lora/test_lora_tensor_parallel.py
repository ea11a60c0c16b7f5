"""LoRA under tensor parallelism: each rank holds its cut of every adapter (B by output rows on the column-parallel
q/k/v and gate/up, A by input columns on the row-parallel o and down, whose partial updates the all-reduce sums),
checked against transformers + peft; a bad adapter is refused without taking the ranks down."""
import pytest
import torch

from tests.lora.peft_adapters import make_adapter, reference_greedy, reference_model
from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
LOGPROB_TOLERANCE = 1e-4   # float32 on both sides; the all-reduce only reorders sums (see test_lora_vs_peft.py)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kv_heads", [2, 1])   # 1: the KV head replicated on both ranks, its B rows whole
def test_tp2_adapters_match_peft_in_a_mixed_batch(kv_heads, make_tiny_model_dir, tmp_path, one_thread):
    base = make_tiny_model_dir(tmp_path, "llama3", num_key_value_heads=kv_heads)
    adapters = [make_adapter(base, tmp_path / "all", rank=8, targets="all-linear", seed=1),
                make_adapter(base, tmp_path / "attn", rank=16, seed=2)]
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (5, 21, 9, 33)]
    lora_requests = [LoRARequest("all", 1, str(adapters[0])), LoRARequest("attn", 2, str(adapters[1])), None,
                     LoRARequest("all", 1, str(adapters[0]))]
    llm = LLM(str(base), dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2, enable_lora=True,
              max_loras=2)
    try:
        with pytest.raises(ValueError, match="has rank 32 .* over max_lora_rank 16"):
            llm.add_lora(LoRARequest("big", 9, str(make_adapter(base, tmp_path / "big", rank=32))))
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                               lora_request=lora_requests)
    finally:
        llm.llm_engine.shutdown()
    references = {None: reference_model(base, None)} | {
        lora.lora_int_id: reference_model(base, lora.lora_path) for lora in lora_requests if lora is not None}
    for prompt, lora, output in zip(prompts, lora_requests, outputs):
        tokens, logprobs = reference_greedy(references[lora and lora.lora_int_id], prompt, GREEDY.max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        ours = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens)])
        torch.testing.assert_close(ours, logprobs[torch.arange(len(tokens)), torch.tensor(tokens)],
                                   atol=LOGPROB_TOLERANCE, rtol=0)
