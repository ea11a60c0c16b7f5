"""The offline API on the bundled model: shapes, order, sampling semantics, errors."""
import logging

import pytest
import torch

from pagedllm import LLM, RequestOutput, SamplingParams

PROMPTS = ["Tell me a story about a robot.", "What is 2 + 2?", "Name a colour.",
           "Write a limerick about a cat who learned to code in Python."]


# batch_invariant: a request's tokens bitwise the same alone, in a batch and as one of n samples (the
# quantized layers run one kernel for every row count).
LLM_SETTINGS = dict(dtype="float32", batch_invariant=True, kv_cache_memory="256MiB")


def test_outputs_come_back_in_input_order_with_vllm_fields(llm):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert [o.prompt for o in outputs] == PROMPTS
    for prompt, output in zip(PROMPTS, outputs):
        assert isinstance(output, RequestOutput) and output.finished
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        completion = output.outputs[0]
        assert completion.finish_reason in ("stop", "length")
        assert completion.text == tokenizer.decode(completion.token_ids)
        assert 1 <= len(completion.token_ids) <= 8


def test_one_params_per_prompt(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 3, 5, 7)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 3, 5, 7]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    in_batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, seeded, others],
                            use_tqdm=False)[1].outputs[0].token_ids
    assert alone == again == in_batch
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate(PROMPTS[0], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_min_tokens_suppresses_eos(llm):
    chat = [{"role": "user", "content": "Reply with just the word yes."}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 30
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=40),
                      use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= 40
    eos_ids = set(llm.llm_engine.model_config.eos_token_ids)
    assert not eos_ids.intersection(longer.token_ids[:39])


def test_stop_strings_cut_the_text(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text
    stop = full[10:14]
    assert stop.strip(), "pick a stop string with visible characters"
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == full[:full.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop


def test_stop_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[5]
    cut = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == full[:full.index(stop_id) + 1]
    assert cut.stop_reason == stop_id


def test_parallel_samples_match_running_each_child_alone(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    output = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for child in output.outputs:
        alone = SamplingParams(temperature=1.0, seed=7 + child.index, max_tokens=12, ignore_eos=True)
        assert child.token_ids == llm.generate(PROMPTS[2], alone, use_tqdm=False)[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_best_of_keeps_the_most_likely(llm):
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=0)
    output = llm.generate(PROMPTS[3], params, use_tqdm=False)[0]
    assert len(output.outputs) == 2
    kept = [c.cumulative_logprob for c in output.outputs]
    assert kept == sorted(kept, reverse=True)
    all_four = []
    for index in range(4):
        alone = SamplingParams(temperature=1.0, seed=3 + index, max_tokens=8, ignore_eos=True, logprobs=0)
        all_four.append(llm.generate(PROMPTS[3], alone, use_tqdm=False)[0].outputs[0].cumulative_logprob)
    assert kept == pytest.approx(sorted(all_four, reverse=True)[:2], abs=1e-4)


def test_chat_applies_the_template(llm):
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    output = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True)
    assert output.prompt_token_ids == expected
    two = llm.chat([conversation, conversation[1:]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(two) == 2


def test_multibyte_text_round_trips(llm):
    output = llm.generate("请用中文回答：你好吗？🙂", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert output.text == llm.get_tokenizer().decode(output.token_ids)
    assert "\ufffd" not in output.text[:-1]


def test_bad_input_names_the_problem(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=10**6), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 entries for 4 prompts"):
        llm.generate(PROMPTS, [SamplingParams()] * 2, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_the_engine_seed_fixes_unseeded_sampling(make_tiny_model_dir, tmp_path):
    """LLM(seed=...) seeds the requests that bring no seed of their own: the same engine seed draws the same
    samples, another one others."""
    folder = str(make_tiny_model_dir(tmp_path, "llama"))
    prompts = [{"prompt_token_ids": [5, 17, 42, 9]}, {"prompt_token_ids": [100, 3, 77]}]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sample(seed):
        llm = LLM(folder, dtype="float32", kv_cache_memory="8MiB", seed=seed)
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    first = sample(1)
    assert sample(1) == first and sample(2) != first


def test_unknown_llm_arguments_are_a_type_error_naming_them():
    with pytest.raises(TypeError, match=r"unknown LLM argument\(s\): gpu_layers, temprature"):
        LLM(temprature=0.5, gpu_layers=10)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_explicit_dtype_runs_the_model_and_cache_in_it(dtype, caplog):
    """dtype=bfloat16/float16 on the float path: the layers' weights and the KV cache hold that dtype, the
    start-up log says so, and the model still knows the capital of France."""
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.llm_engine"):
        llm = LLM(dtype=dtype, quantization="none", kv_cache_memory="64MiB")
    runner = llm.llm_engine.runner
    assert runner.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    assert runner.kv_caches[0][0].data.dtype == getattr(torch, dtype)
    assert f"KV cache: {dtype}, " in caplog.text
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in answer, answer
