"""lm-eval, a real outside client, against `pagedllm serve` through its local-completions model: a
loglikelihood task and a generate-until task, both defined here (local JSONL, no hub download).

Its loglikelihoods (read from the legacy echo + logprobs shape) must equal our offline prompt_logprobs,
and its generations our offline greedy outputs; the server and the offline engine run in float32.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from pagedllm import LLM, SamplingParams

MODEL = "smollm2"
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512")
SERVER_FLAGS = (*ENGINE_FLAGS, "--served-model-name", MODEL)
TOLERANCE = 1e-4

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " a small village by the sea"],
     "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Fahrenheit"], "answer": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " warm", " purple"], "answer": 0},
]
PROMPTS = [{"prompt": "List three colours: red,", "target": " green"},
           {"prompt": "Once upon a time, there was a", "target": " princess"}]
UNTIL = ["\n", "."]


def write_tasks(folder) -> None:
    """Two tasks read by lm-eval's TaskManager from `folder`: data through datasets' local json builder."""
    (folder / "questions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in QUESTIONS))
    (folder / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    (folder / "pagedllm_choice.yaml").write_text(textwrap.dedent(f"""\
        task: pagedllm_choice
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / "questions.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        target_delimiter: ""
        metric_list:
          - metric: acc
        """))
    (folder / "pagedllm_generate.yaml").write_text(textwrap.dedent(f"""\
        task: pagedllm_generate
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / "prompts.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{prompt}}}}"
        doc_to_target: "{{{{target}}}}"
        generation_kwargs:
          until: {json.dumps(UNTIL)}
          max_gen_toks: 16
          do_sample: false
        metric_list:
          - metric: exact_match
        """))


@pytest.fixture(scope="module")
def evaluation(server, hf_tokenizer_dir, tmp_path_factory, monkeypatch_module):
    # Imported once the offline switches are set: datasets reads them when first imported.
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    write_tasks(folder)
    lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL, tokenizer=str(hf_tokenizer_dir),
                             tokenizer_backend="huggingface", max_retries=1, num_concurrent=1, max_length=512)
    results = simple_evaluate(model=lm, tasks=["pagedllm_choice", "pagedllm_generate"],
                              task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                              log_samples=True, bootstrap_iters=0)
    return lm, results


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield patch


@pytest.fixture(scope="module")
def offline_llm():
    return LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)


def request_arguments(sample: dict) -> list[tuple]:
    """The (context, continuation) or (context, gen_kwargs) of each of a sample's requests."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):   # {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}
        return [tuple(request.values()) for request in arguments.values()]
    return [tuple(request) for request in arguments]


def test_loglikelihoods_equal_offline_prompt_logprobs(evaluation, offline_llm):
    lm, results = evaluation
    samples = results["samples"]["pagedllm_choice"]
    assert len(samples) == len(QUESTIONS)
    compared = 0
    for sample in samples:
        for (context, continuation), response in zip(request_arguments(sample), sample["resps"]):
            served_loglikelihood = response[0][0]
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            prompt = context_ids + continuation_ids
            output = offline_llm.generate({"prompt_token_ids": prompt},
                                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                          use_tqdm=False)[0]
            offline = sum(output.prompt_logprobs[position][token_id].logprob
                          for position, token_id in enumerate(prompt) if position >= len(context_ids))
            assert abs(served_loglikelihood - offline) < TOLERANCE, (context, continuation)
            compared += 1
    assert compared == sum(len(question["choices"]) for question in QUESTIONS)
    assert results["results"]["pagedllm_choice"]["acc,none"] >= 2 / 3   # the model knows these


def test_generations_equal_offline_greedy_outputs(evaluation, offline_llm):
    lm, results = evaluation
    samples = results["samples"]["pagedllm_generate"]
    assert len(samples) == len(PROMPTS)
    for sample in samples:
        (context, gen_kwargs), = request_arguments(sample)
        stops = [*UNTIL, lm.tokenizer.eos_token]
        expected = offline_llm.generate({"prompt_token_ids": lm.tok_encode(context)},
                                        SamplingParams(temperature=0, max_tokens=16, stop=stops),
                                        use_tqdm=False)[0].outputs[0].text
        assert sample["resps"] == [[expected]]
        assert expected.strip()
