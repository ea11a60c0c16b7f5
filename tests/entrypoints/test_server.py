"""`pagedllm serve` as a real process on loopback, driven by the official openai client and raw httpx.

One server (bundled model, 256 MiB of KV cache, --api-key) serves every test in this module;
tests that need the engine idle wait for /metrics to say so.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.bench.server_process import metric, poll

API_KEY = "test-key"
MODEL = "smollm2"
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 2**20
KV_CACHE_MEMORY = "256MiB"
SERVER_FLAGS = ("--kv-cache-memory", KV_CACHE_MEMORY, "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL,
                "--max-request-body-bytes", str(MAX_BODY_BYTES))
SERVER_API_KEY = API_KEY


# ---- endpoints ----

def test_health_version_models(server, client, http):
    assert httpx.get(f"{server.url}/health").status_code == 200   # open even with --api-key
    assert http.get("/version").json() == {"version": "0.1.0"}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_MODEL_LEN
    startup = next(line for line in server.log().splitlines() if "serving smollm2" in line)
    assert "(dtype " in startup and "KV blocks" in startup and server.url in startup



def test_use_beam_search_returns_the_offline_beams_best_first(client):
    """vLLM's use_beam_search extra: n beams as n choices, equal to LLM.beam_search, streamed or whole."""
    prompt = "A lighthouse keeper's day begins"
    offline = LLM(kv_cache_memory=KV_CACHE_MEMORY, max_model_len=MAX_MODEL_LEN).beam_search(
        prompt, BeamSearchParams(beam_width=3, max_tokens=10))[0].sequences
    beam = {"use_beam_search": True}
    whole = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=10, extra_body=beam)
    assert [choice.text for choice in whole.choices] == [sequence.text for sequence in offline]
    assert [choice.index for choice in whole.choices] == [0, 1, 2] and whole.usage.completion_tokens == sum(
        len(sequence.output_token_ids) for sequence in offline)
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=10, stream=True,
                                           extra_body=beam):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[index] for index in range(3)] == [sequence.text for sequence in offline]
    with pytest.raises(openai.BadRequestError, match="top_p cannot be used with use_beam_search"):
        client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=4, top_p=0.5, extra_body=beam)
    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 10\]"):
        client.completions.create(model=MODEL, prompt=prompt, n=11, max_tokens=4, extra_body=beam)

def test_tokenize_and_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": "Paged attention, block by block."}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 3
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Paged attention, block by block."}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 5   # the chat template adds its role markers


def test_greedy_completion_matches_the_offline_api(client):
    prompt = "The three primary colours are"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    offline = LLM(kv_cache_memory=KV_CACHE_MEMORY, max_model_len=MAX_MODEL_LEN).generate(
        prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    choice = response.choices[0]
    assert choice.text == offline.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8
    assert response.id.startswith("cmpl-") and response.object == "text_completion" and response.model == MODEL


def test_streamed_completion_equals_whole_one_and_reports_usage(client):
    kwargs = dict(model=MODEL, prompt="Hello, my name is", max_tokens=6, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_n_and_prompt_lists_give_one_choice_per_sample(client):
    response = client.completions.create(model=MODEL, prompt=["Once upon a time", "The sea is"], n=2,
                                         max_tokens=4, temperature=1.0, seed=7)
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 16


def test_stop_string_truncates_and_is_reported(client):
    kwargs = dict(model=MODEL, prompt="Hello, my name is", max_tokens=10, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text.split()[2]   # a word inside the greedy answer
    choice = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert choice.text == text[:text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


def test_completion_logprobs_in_the_legacy_shape(client):
    choice = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0,
                                       logprobs=2).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(5)]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and 2 <= len(top) <= 3 and top[token] == value
        assert value == max(top.values())   # greedy picks the most likely token


def test_echo_prepends_the_prompt(client):
    kwargs = dict(model=MODEL, prompt="Hello, my name is", max_tokens=3, temperature=0)
    continuation = client.completions.create(**kwargs).choices[0].text
    assert continuation and client.completions.create(**kwargs, echo=True).choices[0].text == \
        "Hello, my name is" + continuation


def test_chat_completion_with_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You are brief."},
                               {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
        max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.bytes == list(entry.token.encode())


def test_streamed_chat_with_n_2_and_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something."}], n=2, max_tokens=5,
        temperature=1.0, seed=3, stream=True, stream_options={"include_usage": True})
    texts, roles, finish = {0: "", 1: ""}, {}, {}
    chunks = list(stream)
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert set(finish) == {0, 1} and all(texts.values())
    usage = chunks[-1].usage
    assert usage.completion_tokens <= 10 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_metrics_count_exactly_what_a_request_used(server, client):
    before = server.wait_until_idle().text
    response = client.completions.create(model=MODEL, prompt="Counting tokens, one by one:", max_tokens=7,
                                         temperature=0, extra_body={"ignore_eos": True})
    after = server.wait_until_idle().text

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("pagedllm:generation_tokens_total", model_name=MODEL) == response.usage.completion_tokens == 7
    assert delta("pagedllm:prompt_tokens_total", model_name=MODEL) == response.usage.prompt_tokens
    assert delta("pagedllm:request_success_total", finished_reason="length") == 1
    assert delta("pagedllm:time_to_first_token_seconds_count") == 1
    assert delta("pagedllm:time_per_output_token_seconds_count") == 1
    assert delta("pagedllm:e2e_request_latency_seconds_count") == 1
    assert delta("pagedllm:prefix_cache_queries_total") > 0
    for name in ("pagedllm:num_preemptions_total", "pagedllm:prefix_cache_hits_total"):
        assert name in after


# ---- disconnects free their blocks ----

def test_streaming_client_that_leaves_is_aborted(server, http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        events = response.iter_lines()
        assert next(e for e in events if e.startswith("data:"))
        busy = http.get("/metrics").text
        assert metric(busy, "pagedllm:num_requests_running") == 1
        assert metric(busy, "pagedllm:kv_cache_usage_perc") > 0
    idle = server.wait_until_idle()
    assert idle.running == 0 and idle.pool_whole


def test_non_streaming_client_that_leaves_is_aborted(server):
    """The client leaves once /metrics shows its request running: the request is aborted, not finished."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
    finished = "pagedllm:request_success_total"
    before = server.wait_until_idle()

    async def leave_once_running() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120) as client:
            answer = asyncio.create_task(client.post("/v1/completions", json=body))
            figures = await asyncio.to_thread(poll, server.engine_figures,
                                              lambda figures: figures.running or answer.done(), 60)
            assert figures.running and not answer.done()
            answer.cancel()
            await asyncio.wait([answer])   # its connection is closed: the server sees the client leave

    asyncio.run(leave_once_running())
    idle = server.wait_until_idle()
    assert idle.running == 0 and idle.pool_whole
    assert metric(idle.text, finished, finished_reason="length") == metric(before.text, finished,
                                                                            finished_reason="length")


# ---- bad input: OpenAI's error body, and the server carries on ----

def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


BAD_REQUESTS = {
    "malformed JSON": ("/v1/completions", b'{"prompt": "Hi",', 400, None, "not valid JSON"),
    "not an object": ("/v1/completions", b"[1, 2]", 400, None, "valid dictionary"),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt", "Field required"),
    "wrong type": ("/v1/completions", _completion(max_tokens="ten"), 400, "max_tokens", "valid integer"),
    "bool for an int": ("/v1/completions", _completion(n=True), 400, "n", "valid integer"),
    "negative max_tokens": ("/v1/completions", _completion(max_tokens=-1), 400, "max_tokens", ">= 1, got -1"),
    "temperature out of range": ("/v1/completions", _completion(temperature=-0.5), 400, "temperature", ">= 0"),
    "top_p out of range": ("/v1/completions", _completion(top_p=1.5), 400, "top_p", "(0, 1]"),
    "too many logprobs": ("/v1/completions", _completion(logprobs=21), 400, "logprobs", "[0, 20]"),
    "empty prompt list": ("/v1/completions", _completion(prompt=[]), 400, "prompt", "empty"),
    "token id outside the vocabulary": ("/v1/completions", _completion(prompt=[10**9]), 400, "prompt",
                                        "prompt_token_ids"),
    "prompt + max_tokens too long": ("/v1/completions", _completion(max_tokens=2000), 400, "prompt",
                                     f"max_tokens (2000) = 2001 exceeds max_model_len ({MAX_MODEL_LEN})"),
    "prompt alone too long": ("/v1/completions", _completion(prompt="hello " * 1500), 400, "prompt",
                              f"max_model_len is {MAX_MODEL_LEN}"),
    "unknown model": ("/v1/completions", _completion(model="gpt-4"), 404, "model", "'gpt-4' does not exist"),
    "chat: unknown role": ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, 400,
                           "messages.0.role", "'user', 'assistant' or 'tool'"),
    "chat: image part": ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
                         400, "messages.0.content", "Input should be 'text'"),
    "chat: no messages": ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    "chat: bad max_completion_tokens": ("/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "Hi"}],
                                         "max_completion_tokens": 0}, 400, "max_completion_tokens", ">= 1"),
    "chat: top_logprobs without logprobs": ("/v1/chat/completions",
                                            {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2},
                                            400, "top_logprobs", "logprobs"),
    "detokenize: id outside the vocabulary": ("/detokenize", {"tokens": [-1]}, 400, "tokens", "[0, "),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_gets_an_openai_error_and_the_server_carries_on(http, case):
    path, body, status, param, message = BAD_REQUESTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert http.post("/v1/completions", json=_completion(max_tokens=1)).status_code == 200


def test_oversized_bodies_are_refused_with_413(http):
    too_big = json.dumps(_completion(prompt="a" * MAX_BODY_BYTES)).encode()
    declared = http.post("/v1/completions", content=too_big, headers={"Content-Type": "application/json"})

    def chunked():   # no Content-Length: the server must count the bytes as they come
        for start in range(0, len(too_big), 64 * 1024):
            yield too_big[start:start + 64 * 1024]

    streamed = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
    assert http.post("/v1/completions", json=_completion(max_tokens=1)).status_code == 200


def test_api_key_is_required_and_checked(server):
    body = _completion(max_tokens=1)
    missing = httpx.post(f"{server.url}/v1/completions", json=body)
    wrong = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    for response, code in ((missing, "missing_api_key"), (wrong, "invalid_api_key")):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == code
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
