"""The server's request fields: logit controls and prompt logprobs through the openai client, echo with
logprobs in the legacy shape, and every undeclared field honoured, refused with a 400 or logged once.

One float32 server (bundled model) serves the module; offline prompt_logprobs are the reference.
"""
from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.request_fields import POLICIES, NoOp, Refused, check_undeclared_fields
from pagedllm.entrypoints.openai.errors import APIError

MODEL = "smollm2"
SERVER_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--served-model-name", MODEL)
LLM_SETTINGS = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)   # the offline reference
PROMPT = "The lighthouse keeper climbed the stairs"
TOLERANCE = 1e-4
CHAT = [{"role": "user", "content": "Say hello."}]


def offline_prompt_logprobs(llm: LLM, prompt_ids: list[int], k: int):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].prompt_logprobs


# ---------------------------------------------------------------- echo + logprobs, prompt_logprobs

@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_echo_with_logprobs_gives_the_prompts_logprobs_first(client, llm, max_tokens):
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    choice = client.completions.create(model=MODEL, prompt=prompt_ids, echo=True, logprobs=2, max_tokens=max_tokens,
                                       temperature=0).choices[0]
    logprobs = choice.logprobs
    expected = offline_prompt_logprobs(llm, prompt_ids, 2)
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


def test_prompt_logprobs_extra_has_vllms_shape(http, llm):
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    expected = offline_prompt_logprobs(llm, prompt_ids, 1)
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


# ---------------------------------------------------------------- /v1/completions: refused and no-op fields

# vLLM's /v1/completions extras this server does not implement, each of which would change the answer.
REFUSED_COMPLETION_FIELDS = {"truncate_prompt_tokens": 8, "add_special_tokens": False, "logits_processors": ["x"]}


@pytest.mark.parametrize("name", sorted(REFUSED_COMPLETION_FIELDS))
def test_refused_completion_fields_are_400s_naming_them(http, name):
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                  name: REFUSED_COMPLETION_FIELDS[name]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == name and name in response.json()["error"]["message"]


def test_completion_no_op_fields_change_nothing_and_their_other_values_are_refused(http):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    no_ops = {"user": "u-1", "safety_identifier": "s", "prompt_cache_key": "k", "metadata": {"a": "b"},
              "store": False, "service_tier": "default", "guided_decoding_backend": "xgrammar"}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with_no_ops = http.post("/v1/completions", json={**body, **no_ops})
    assert with_no_ops.status_code == 200 and with_no_ops.json()["choices"][0]["text"] == plain != ""
    for name, value in (("store", True), ("service_tier", "flex"), ("guided_decoding_backend", "outlines")):
        response = http.post("/v1/completions", json={**body, name: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == name


# ---------------------------------------------------------------- sampling fields, each with its effect

def greedy_completion(http, prompt=PROMPT, **fields) -> dict:
    response = http.post("/v1/completions", json={"prompt": prompt, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def token_ids(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_best_of_returns_the_candidate_with_the_highest_cumulative_logprob(http, llm):
    """The server's one answer out of best_of=4 seeded samples is, of the four samples the offline engine
    draws for the same seed, the one whose token log-probabilities sum highest (summed here)."""
    fields = dict(max_tokens=8, temperature=1.0, seed=11)
    candidates = llm.generate(PROMPT, SamplingParams(n=4, best_of=4, logprobs=0, **fields),
                              use_tqdm=False)[0].outputs
    sums = [sum(step[token].logprob for step, token in zip(c.logprobs, c.token_ids)) for c in candidates]
    assert len(set(c.text for c in candidates)) > 1, "the samples do not differ: the choice would prove nothing"
    best = candidates[max(range(4), key=sums.__getitem__)].text
    answer = http.post("/v1/completions", json={"prompt": PROMPT, "n": 1, "best_of": 4, **fields}).json()
    assert [choice["text"] for choice in answer["choices"]] == [best]


def test_stop_token_ids_stop_at_that_token(http, llm):
    whole = greedy_completion(http, max_tokens=12, ignore_eos=True)["text"]
    ids = token_ids(llm, whole)
    stop_id = ids[4]
    cut = ids.index(stop_id)   # its first occurrence
    choice = greedy_completion(http, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert choice["text"] == llm.get_tokenizer().decode(ids[:cut])   # the stop token's text is left out


def test_min_tokens_holds_back_eos_until_then(client, llm):
    """A chat answer that ends early (EOS after k tokens) runs to at least min_tokens = k + 5 with it."""
    natural = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=64, temperature=0)
    k = natural.usage.completion_tokens
    assert natural.choices[0].finish_reason == "stop" and k < 40, "the answer must end by EOS, well short"
    longer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=64, temperature=0,
                                            extra_body={"min_tokens": k + 5})
    assert longer.usage.completion_tokens >= k + 5
    assert longer.choices[0].message.content.startswith(natural.choices[0].message.content)


def test_include_stop_str_in_output(http):
    whole = greedy_completion(http, max_tokens=12, ignore_eos=True)["text"]
    stop = whole.split()[2]
    kept = greedy_completion(http, max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == whole[:whole.index(stop) + len(stop)] and kept["finish_reason"] == "stop"


@pytest.mark.parametrize("skip_special_tokens, spaces_between_special_tokens", [
    (True, True), (False, True), (False, False)])
def test_special_tokens_in_the_text(http, llm, skip_special_tokens, spaces_between_special_tokens):
    """Three forced <|im_start|> tokens (logit_bias +100): skipped or spelled out, as the HF tokenizer's own
    decode gives them. spaces_between_special_tokens changes nothing with a fast tokenizer, as in vLLM."""
    hf = llm.get_tokenizer().hf
    special = hf.convert_tokens_to_ids("<|im_start|>")
    choice = greedy_completion(http, max_tokens=3, logit_bias={str(special): 100}, ignore_eos=True,
                               skip_special_tokens=skip_special_tokens,
                               spaces_between_special_tokens=spaces_between_special_tokens)
    assert choice["text"] == hf.decode([special] * 3, skip_special_tokens=skip_special_tokens)
    assert choice["text"] == ("" if skip_special_tokens else "<|im_start|>" * 3)


def test_top_k_one_and_min_p_one_are_greedy(http):
    greedy = greedy_completion(http, max_tokens=10, ignore_eos=True)["text"]
    for fields in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "ignore_eos": True,
                                                     "temperature": 1.5, "seed": 3, **fields}).json()
        assert sampled["choices"][0]["text"] == greedy, fields


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_penalties_move_the_greedy_choice_as_their_formula_says(client, penalty):
    """Greedy with a penalty against the plain greedy run's top-20 log-probabilities, penalised here by the
    OpenAI formula (presence: minus p once a token has been generated; frequency: minus p per time): the
    two runs share a prefix, and where they first part the penalised run picks the top of the hand-penalised
    list (the runs part at the 9th token on this prompt)."""
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=20,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].logprobs
    penalised = client.completions.create(**kwargs, **{penalty: 1.5}).choices[0].logprobs.tokens
    generated: list[str] = []
    for position, (token, top) in enumerate(zip(plain.tokens, plain.top_logprobs)):
        def adjusted(candidate):
            count = generated.count(candidate)
            return top[candidate] - 1.5 * (min(count, 1) if penalty == "presence_penalty" else count)
        expected = max(top, key=adjusted)
        assert penalised[position] == expected, (position, penalised, plain.tokens)
        if expected != token:
            return   # the runs part here: what follows has other contexts
        generated.append(token)
    pytest.fail(f"the {penalty} never changed the greedy choice: the test proved nothing")


def test_repetition_penalty_reaches_the_sampler(http, llm):
    """The sampler's rule (positive logits of prompt and output tokens divided by the penalty, negative ones
    multiplied) is held to hand-computed logits in test_sampling.py; here the server's field must be that
    rule: its greedy answer is the offline engine's with the same penalty, and not the plain one."""
    fields = dict(max_tokens=16, ignore_eos=True)
    plain = greedy_completion(http, **fields)["text"]
    penalised = greedy_completion(http, repetition_penalty=1.5, **fields)["text"]
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, repetition_penalty=1.5, **fields),
                           use_tqdm=False)[0].outputs[0].text
    assert penalised == offline
    assert penalised != plain, "the penalty changed nothing: the test would prove nothing"
