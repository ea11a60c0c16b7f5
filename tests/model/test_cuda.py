"""The engine on a CUDA GPU: greedy tokens against transformers, the KV pool sized by a profile run, pinned step
inputs, and no host synchronisation in a step but the fetch of its sampled ids. They skip without a GPU;
scripts/gpu_check.sh runs them (the Triton kernels' own tests, tests/model/test_triton_kernels.py, run on the GPU there
too, with the tolerances their `tolerance` states)."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.worker import host_staging, model_runner

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
MAX_NEW_TOKENS = 32
# float32 on the GPU: cuBLAS and our kernels in IEEE float32 (TF32 off, torch's default for matmuls), summing in
# other orders than transformers: logprobs agree to ~1e-5; 1e-3 leaves a margin, and the tokens must be equal.
LOGPROB_TOLERANCE = 1e-3
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ",
         "PagedAttention stores the key-value cache in fixed-size blocks. " * 6,
         "List three prime numbers and explain why each one is prime, step by step."]


@pytest.fixture(scope="module")
def cuda_llm():
    return LLM(dtype="float32", quantization="none", device="cuda", kv_cache_memory="2GiB")


def test_greedy_tokens_match_transformers_on_cuda_in_float32(cuda_llm, bundled_gguf_path):
    assert cuda_llm.llm_engine.runner.attention_backend.name == "triton"
    reference = AutoModelForCausalLM.from_pretrained(bundled_gguf_path.parent, gguf_file=bundled_gguf_path.name,
                                                     dtype=torch.float32).to(CUDA).eval()
    reference.generation_config.eos_token_id = None
    tokenizer = cuda_llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in TEXTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = cuda_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt_ids, output in zip(prompts, outputs):
        generated = reference.generate(torch.tensor([prompt_ids], device=CUDA), max_new_tokens=MAX_NEW_TOKENS,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True,
                                       pad_token_id=0)
        expected = generated.sequences[0, len(prompt_ids):].tolist()
        completion = output.outputs[0]
        assert list(completion.token_ids) == expected
        logprobs = torch.log_softmax(torch.stack(generated.logits)[:, 0].float(), dim=-1).cpu()
        ours = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, expected)])
        torch.testing.assert_close(ours, logprobs[torch.arange(len(expected)), torch.tensor(expected)],
                                   atol=LOGPROB_TOLERANCE, rtol=0)


def test_kv_pool_is_sized_by_the_profile_run_within_gpu_memory_utilization():
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(dtype="bfloat16", quantization="none", device="cuda", gpu_memory_utilization=0.3)
    assert llm.llm_engine.kv_manager.pool.num_blocks > 1000
    llm.generate("Hello", SamplingParams(max_tokens=8), use_tqdm=False)
    free, total = torch.cuda.mem_get_info()
    # what the whole device holds now (this process and any other) stays within the share, give or take
    # the allocator's rounding
    assert total - free <= 0.3 * total + 512 * 2**20
    del llm
    torch.cuda.empty_cache()


def test_pinned_staging_reuses_its_buffers_and_copies_right():
    staging = host_staging.HostStaging(CUDA)
    for length in (5, 3, 9):
        array = np.arange(length, dtype=np.int64) * 7
        on_device = staging.to_device("positions", array)
        assert on_device.is_cuda and on_device.tolist() == array.tolist()
    assert staging.buffers["positions"].is_pinned() and staging.buffers["positions"].numel() >= 9


def test_a_step_synchronises_only_to_fetch_its_sampled_ids(cuda_llm, monkeypatch):
    """torch's sync debug mode raises at any synchronising call (a .item(), a blocking copy...) in the step;
    it is lifted only while the runner fetches the sampled ids."""
    real_fetch = model_runner.fetch

    def fetch_without_the_check(tensors):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real_fetch(tensors)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(model_runner, "fetch", fetch_without_the_check)
    engine = cuda_llm.llm_engine
    engine.add_request("a", "Count to ten: one, two,", SamplingParams(temperature=0, max_tokens=4))
    engine.add_request("b", "Paged memory", SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=4,
                                                           logprobs=2, repetition_penalty=1.1))
    engine.step()   # the prefill, pinned buffers first allocated (allocation itself synchronises nothing)
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
