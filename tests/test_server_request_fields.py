"""The server's request fields: logit controls and prompt logprobs through the openai client, echo with
logprobs in the legacy shape, and every undeclared field honoured, refused with a 400 or logged once.

One float32 server (bundled model) serves the module; offline prompt_logprobs are the reference.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.reliability.server import ServerProcess
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.request_fields import POLICIES, NoOp, Refused, check_undeclared_fields
from pagedllm.entrypoints.openai.errors import APIError

MODEL = "smollm2"
FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--served-model-name", MODEL)
PROMPT = "The lighthouse keeper climbed the stairs"
TOLERANCE = 1e-4
CHAT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("fields-server") / "server.log", *FLAGS)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def offline():
    return LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)


def offline_prompt_logprobs(offline: LLM, prompt_ids: list[int], k: int):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    return offline.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].prompt_logprobs


# ---------------------------------------------------------------- echo + logprobs, prompt_logprobs

@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_echo_with_logprobs_gives_the_prompts_logprobs_first(client, offline, max_tokens):
    prompt_ids = offline.get_tokenizer().encode(PROMPT)
    choice = client.completions.create(model=MODEL, prompt=prompt_ids, echo=True, logprobs=2, max_tokens=max_tokens,
                                       temperature=0).choices[0]
    logprobs = choice.logprobs
    expected = offline_prompt_logprobs(offline, prompt_ids, 2)
    assert len(logprobs.tokens) == len(prompt_ids) + max_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(prompt_ids)):
        entry = expected[position]
        assert abs(logprobs.token_logprobs[position] - entry[prompt_ids[position]].logprob) < TOLERANCE
        assert logprobs.top_logprobs[position].keys() == {lp.decoded_token for lp in entry.values()}
    assert "".join(logprobs.tokens[:len(prompt_ids)]) == PROMPT == choice.text[:len(PROMPT)]
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    if max_tokens == 0:   # vLLM's echo-only request: the prompt alone
        assert choice.text == PROMPT and choice.finish_reason == "length"


def test_streamed_echo_assembles_into_the_whole_answer(client):
    request = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=5, temperature=0)
    whole = client.completions.create(**request).choices[0]
    chunks = [chunk.choices[0] for chunk in client.completions.create(**request, stream=True) if chunk.choices]
    assert "".join(chunk.text for chunk in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "text_offset"):
        streamed = [value for chunk in chunks if chunk.logprobs for value in getattr(chunk.logprobs, field)]
        assert streamed == getattr(whole.logprobs, field)
    only_prompt = [chunk for chunk in client.completions.create(**{**request, "max_tokens": 0}, stream=True)
                   if chunk.choices]
    assert "".join(chunk.choices[0].text for chunk in only_prompt) == PROMPT


def test_echo_only_usage_counts_no_completion_tokens(http):
    body = http.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 0}).json()
    assert body["usage"]["completion_tokens"] == 0
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}).json()["error"]["param"] == \
        "max_tokens"   # without echo, max_tokens 0 asks for nothing


def test_prompt_logprobs_extra_has_vllms_shape(http, offline):
    prompt_ids = offline.get_tokenizer().encode(PROMPT)
    expected = offline_prompt_logprobs(offline, prompt_ids, 1)
    completion = http.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 2, "prompt_logprobs": 1})
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0})
    served = completion.json()["choices"][0]["prompt_logprobs"]
    assert served[0] is None and len(served) == len(prompt_ids)
    for position in range(1, len(prompt_ids)):
        assert served[position].keys() == {str(token_id) for token_id in expected[position]}
        for token_id, logprob in expected[position].items():
            entry = served[position][str(token_id)]
            assert abs(entry["logprob"] - logprob.logprob) < TOLERANCE
            assert (entry["rank"], entry["decoded_token"]) == (logprob.rank, logprob.decoded_token)
    chat_entries = chat.json()["prompt_logprobs"]
    assert chat_entries[0] is None and all(len(entry) == 1 for entry in chat_entries[1:])
    for path, body in (("/v1/completions", {"prompt": prompt_ids, "prompt_logprobs": 1}),
                       ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 0})):
        streamed = http.post(path, json={**body, "max_tokens": 3, "stream": True})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        sent = [event.get("prompt_logprobs") or event["choices"][0].get("prompt_logprobs")
                for event in events if event["choices"]]
        sent = [entries for entries in sent if entries]
        assert sent == [served if path == "/v1/completions" else chat_entries]   # once, as in the whole answer


# ---------------------------------------------------------------- logit controls

def test_logit_bias_through_the_openai_client(client, http):
    forced_id = 1234
    forced = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                            logit_bias={str(forced_id): 100})
    forced_text = http.post("/detokenize", json={"tokens": [forced_id] * 4}).json()["prompt"]
    assert forced.choices[0].message.content == forced_text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    first_id = http.post("/tokenize", json={"prompt": plain, "add_special_tokens": False}).json()["tokens"][0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={str(first_id): -100}).choices[0].text
    banned_ids = http.post("/tokenize", json={"prompt": banned, "add_special_tokens": False}).json()["tokens"]
    assert banned_ids[0] != first_id


def test_allowed_token_ids_and_bad_words_as_extras(client, http):
    allowed = [11, 260, 314]
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=1,
                                       extra_body={"allowed_token_ids": allowed, "ignore_eos": True}).choices[0]
    ids = http.post("/tokenize", json={"prompt": choice.text, "add_special_tokens": False}).json()["tokens"]
    assert set(ids) <= set(allowed)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    word = plain.split()[0]
    without = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"bad_words": [word]}).choices[0].text
    assert word not in without.split()


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"one": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_bad_logit_controls_are_400s_naming_the_field(http, body, param):
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# ---------------------------------------------------------------- no silent drops

REFUSED_CHAT = sorted(name for name, rule in POLICIES["chat"].items() if isinstance(rule, Refused))


@pytest.mark.parametrize("name", REFUSED_CHAT)
def test_refused_chat_fields_are_400s_naming_them(http, name):
    response = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, name: {"x": 1}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == name and name in response.json()["error"]["message"]


def test_nested_fields_are_judged_too(http):
    message = {**CHAT[0], "audio": {"id": "audio_1"}}
    response = http.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.audio"
    named = http.post("/v1/chat/completions", json={"messages": [{**CHAT[0], "name": "ann"}], "max_tokens": 2})
    assert named.status_code == 200


def test_no_op_fields_change_nothing(http):
    no_ops = {"user": "u-1", "safety_identifier": "s", "prompt_cache_key": "k", "metadata": {"a": "b"},
              "store": False, "service_tier": "auto", "modalities": ["text"],
              "stream_options": {"include_usage": True, "include_obfuscation": False}, "stream": True}
    plain = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "temperature": 0,
                                                    "stream": True})
    with_no_ops = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "temperature": 0,
                                                          **no_ops})
    assert with_no_ops.status_code == 200

    def text(response) -> str:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text(with_no_ops) == text(plain) != ""
    for name, value in (("store", True), ("service_tier", "flex"), ("modalities", ["text", "audio"])):
        response = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, name: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == name


def test_unknown_fields_are_logged_once_and_ignored(http, server):
    for _ in range(2):
        response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "frobnicate": 1})
        assert response.status_code == 200
    assert server.log().count("ignoring the unknown field 'frobnicate'") == 1


def test_declaring_a_field_is_all_it_takes_to_honour_it():
    """A refused field (prediction) is refused only while undeclared: a request model that declares it
    passes the check, so its own code decides."""
    body = {"messages": CHAT, "prediction": {"type": "content", "content": "x"}}
    with pytest.raises(APIError, match="prediction is not supported"):
        check_undeclared_fields(ChatCompletionRequest.model_validate(body))

    class WithPrediction(ChatCompletionRequest):
        prediction: dict | None = None
    check_undeclared_fields(WithPrediction.model_validate(body))
    check_undeclared_fields(CompletionRequest.model_validate({"prompt": "x", "user": "u"}))
    assert all(isinstance(rule, (NoOp, Refused)) for policy in POLICIES.values() for rule in policy.values())
