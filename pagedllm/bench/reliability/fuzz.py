"""Property-based fuzzing of a live server's HTTP API.

The property: every answer is a 2xx of the documented shape or a 4xx with OpenAI's error body
({"error": {"message", "type", "param", "code"}}), never a 5xx, a hang or a dropped connection;
and afterwards the server is still up with every KV block back in its pool. Requests come from:

- run_fuzz: the hypothesis strategies below, for completions and chat: odd Unicode, sampling
  fields at and past their limits, wrong types, missing fields, bodies JSON cannot express (NaN).
- run_schemathesis: schemathesis over the server's own /openapi.json, each answer checked against it.

Both record what they find in a FuzzResult instead of raising, so `pagedllm bench reliability`
can print the figures and the tests can assert on them.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import httpx
import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok

from pagedllm.bench.reliability.server import EngineFigures
from pagedllm.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_SAMPLES

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
IDLE_TIMEOUT = 30.0   # seconds the engine gets to finish and free its blocks once fuzzing stops
_SHOWN = 300          # characters of a request or an answer kept in a violation
# A conversation whose prompt length run_fuzz measures, so max_tokens can be drawn exactly at the context's end.
BOUNDARY_CHAT = [{"role": "user", "content": "Hi"}]


# ---------------------------------------------------------------- results

@dataclass
class FuzzResult:
    cases: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)   # "2xx", "4xx", "5xx", "no answer", ...
    violations: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def count(self, outcome: str) -> None:
        self.cases += 1
        self.status_counts[outcome] = self.status_counts.get(outcome, 0) + 1


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def _status_class(status: int) -> str:
    return f"{status // 100}xx"


# ---------------------------------------------------------------- strategies

# Characters that break naive text handling: NUL and controls, zero-width and bidi controls,
# right-to-left scripts, combining marks, astral and private-use code points, ZWJ emoji sequences,
# the model's special tokens and chat-template syntax (which must stay plain text).
ODD_TEXT = ("\x00", "\t", "\r\n", "\x1b[31m", "\x7f", "\u200b", "\u200d", "\u2060", "\ufeff", "\u202e", "\u2067",
            "\u200f", "שלום", "مرحبا", "e\u0301", "Z\u0336\u0335\u0334", "\u20dd", "😀", "👩\u200d👩\u200d👧",
            "𝕳𝖊𝖑𝖑𝖔", "𠀀", "\U0010fffd", "\ufffd", "\uffff", "<|im_start|>", "<|endoftext|>", "{{ 7*7 }}",
            "{% for x in y %}", "\\u0000", "")
TEXT = st.one_of(st.text(max_size=30),
                 st.lists(st.sampled_from(ODD_TEXT) | st.text(max_size=4), max_size=10).map("".join))
NON_EMPTY_TEXT = TEXT.filter(bool)
# Up to 300k characters: over any context length, within the default 4 MiB body limit even at 4 bytes each.
LONG_TEXT = st.builds(lambda piece, size: (piece * (size // len(piece) + 1))[:size], NON_EMPTY_TEXT,
                      st.integers(2_000, 300_000))
# Values of a wrong JSON type for most fields.
WRONG_TYPE = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.floats(allow_nan=False),
                       st.sampled_from(["1", "true", "NaN", "", [], {}, [1], {"value": 1}]))
HUGE_INTS = st.sampled_from([2**31 - 1, 2**31, 2**53 + 1, INT64_MAX, INT64_MAX + 1, 2**64, INT64_MIN,
                             INT64_MIN - 1, -1, 10**30, 10**400])
# JSON has no NaN or Infinity, but Python's json writes and reads them as bare literals: raw bodies a client may send.
ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-300, 1e-5, 0.9999999, 1.0000001,
                              2.0000001, -2.0000001, 1e308, -1e308, 2.0**63, 10**400])
TOKEN_IDS = st.integers(3, 255)   # in any model's vocabulary
SMALL_MAX_TOKENS_LIMIT = 4
SMALL_MAX_TOKENS = st.integers(1, SMALL_MAX_TOKENS_LIMIT)
# At and past the bundled model's vocabulary (49152 ids), negative, past int64, of a wrong type.
EDGE_TOKEN_IDS = st.sampled_from([-1, 49151, 49152, 10**6, INT64_MAX, INT64_MAX + 1, True, 1.5, "7"])


@dataclass(frozen=True)
class FieldValues:
    """What a request field is drawn from: values it accepts, and values at or past its limits."""
    valid: st.SearchStrategy
    edge: st.SearchStrategy


def _stop_lists() -> st.SearchStrategy:
    """Stop lists from empty to tens of thousands of strings (each one checked against every new token)."""
    many = st.builds(lambda text, size: [f"{text}{i}" for i in range(size)], TEXT, st.integers(100, 20_000))
    return st.one_of(st.sampled_from([[], [""], [1], ""]), many, LONG_TEXT)


SAMPLING_FIELDS = {
    "temperature": FieldValues(st.sampled_from([0, 0.0, 0.7, 1]) | st.floats(0, 2), ODD_FLOATS | st.floats(-10, 0)),
    "top_p": FieldValues(st.floats(0.05, 1), ODD_FLOATS | st.sampled_from([0, -0.5, 1.5])),
    "top_k": FieldValues(st.sampled_from([-1, 0, 1, 5, 50, 49152, 10**9]), HUGE_INTS | st.sampled_from([-2, 1.0])),
    "min_p": FieldValues(st.floats(0, 1), ODD_FLOATS | st.sampled_from([-0.1, 1.1])),
    "presence_penalty": FieldValues(st.floats(-2, 2), ODD_FLOATS),
    "frequency_penalty": FieldValues(st.floats(-2, 2), ODD_FLOATS),
    "repetition_penalty": FieldValues(st.floats(0.5, 2), ODD_FLOATS | st.sampled_from([0, -1, 1e-308])),
    "seed": FieldValues(st.integers(0, 2**32), HUGE_INTS),
    "max_tokens": FieldValues(SMALL_MAX_TOKENS, HUGE_INTS | st.sampled_from([0, -1, 1.0, None])),
    "min_tokens": FieldValues(st.integers(0, 2), HUGE_INTS | st.sampled_from([-1, 5, 500])),
    "n": FieldValues(st.integers(1, 3), HUGE_INTS | st.sampled_from([0, -1, MAX_SAMPLES, MAX_SAMPLES + 1, True, 1.0])),
    "stop": FieldValues(NON_EMPTY_TEXT | st.lists(NON_EMPTY_TEXT, max_size=4), _stop_lists()),
    "stop_token_ids": FieldValues(st.lists(TOKEN_IDS, max_size=4), st.lists(EDGE_TOKEN_IDS, min_size=1, max_size=3)
                                  | st.just(5)),
    "ignore_eos": FieldValues(st.booleans(), st.sampled_from([0, 1, "true"])),
    "skip_special_tokens": FieldValues(st.booleans(), st.sampled_from([0, "false"])),
    "spaces_between_special_tokens": FieldValues(st.booleans(), st.sampled_from([1, "no"])),
    "include_stop_str_in_output": FieldValues(st.booleans(), st.sampled_from([1, None])),
    "stream_options": FieldValues(st.just({"include_usage": True}) | st.just({"include_usage": False}),
                                  st.sampled_from([{"include_usage": 1}, "usage", {"extra": True}])),
    "logit_bias": FieldValues(st.dictionaries(TOKEN_IDS.map(str), st.floats(-100, 100), max_size=3),
                              st.sampled_from([{"x": "y"}, [1], {"1": 100.5}, {"-1": 1}, {"99999999": 1}])),
    "allowed_token_ids": FieldValues(st.lists(TOKEN_IDS, min_size=1, max_size=4),
                                     st.lists(EDGE_TOKEN_IDS, max_size=3) | st.just([1.5])),
    "bad_words": FieldValues(st.lists(NON_EMPTY_TEXT, max_size=3), st.sampled_from([[""], [" "], "word", [1]])),
    "prompt_logprobs": FieldValues(st.integers(0, MAX_LOGPROBS),
                                   HUGE_INTS | st.sampled_from([-1, MAX_LOGPROBS + 1, True])),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "best_of": FieldValues(st.integers(1, 3), HUGE_INTS | st.sampled_from([0, MAX_SAMPLES, MAX_SAMPLES + 1])),
    "logprobs": FieldValues(st.sampled_from([0, 1, 5, MAX_LOGPROBS]),
                            HUGE_INTS | st.sampled_from([MAX_LOGPROBS + 1, True, 1.0])),
    "echo": FieldValues(st.booleans(), st.sampled_from([1, "yes"])),
    "suffix": FieldValues(st.just(""), TEXT),
}
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "max_completion_tokens": SAMPLING_FIELDS["max_tokens"],
    "logprobs": FieldValues(st.booleans(), st.sampled_from([1, "true", None])),
    "top_logprobs": FieldValues(st.sampled_from([0, 1, MAX_LOGPROBS]),
                                HUGE_INTS | st.sampled_from([MAX_LOGPROBS + 1, True])),
    "add_generation_prompt": FieldValues(st.booleans(), st.sampled_from([1, "no"])),
    "tools": FieldValues(st.just([]), st.sampled_from([[{"type": "function"}], "tools"])),
}


def prompts(max_model_len: int) -> FieldValues:
    """Completion prompts: text, lists of text, token ids and lists of those; at the edge, empty, too long
    or ill-typed ones."""
    token_lists = st.lists(TOKEN_IDS, min_size=1, max_size=8)
    valid = st.one_of(NON_EMPTY_TEXT, st.lists(NON_EMPTY_TEXT, min_size=1, max_size=3), token_lists,
                      st.lists(token_lists, min_size=1, max_size=3))
    too_long = st.builds(lambda token_id, extra: [token_id] * (max_model_len + extra), TOKEN_IDS, st.integers(0, 2))
    edge = st.one_of(st.sampled_from(["", [], [[]], [""], [1, "a"], [[1], "a"], [1.5], [True], {"text": "a"}]),
                     st.lists(EDGE_TOKEN_IDS, min_size=1, max_size=3), LONG_TEXT, too_long, TEXT)
    return FieldValues(valid, edge)


def _content_parts(text: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(st.builds(lambda t: {"type": "text", "text": t}, text), min_size=1, max_size=3)


MESSAGE = FieldValues(
    valid=st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": TEXT | _content_parts(TEXT)}),
    edge=st.fixed_dictionaries({}, optional={
        "role": st.sampled_from(["tool", "developer", "USER", "", 1, None]) | TEXT,
        "content": st.one_of(LONG_TEXT, WRONG_TYPE, _content_parts(WRONG_TYPE),
                             st.sampled_from([[{"type": "image_url", "image_url": "x"}], [{"text": "no type"}]])),
        "name": TEXT}))


def conversations() -> FieldValues:
    """Chat messages: valid conversations; at the edge, odd or ill-formed messages, none, or hundreds."""
    valid = st.lists(MESSAGE.valid, min_size=1, max_size=5)
    edge = st.one_of(st.lists(MESSAGE.valid | MESSAGE.edge, min_size=1, max_size=4),
                     st.builds(lambda message, count: [message] * count, MESSAGE.valid, st.integers(50, 500)),
                     st.sampled_from([[], "Hi", {"role": "user"}, [None], ["Hi"]]))
    return FieldValues(valid, edge)


@st.composite
def request_bodies(draw, fields: dict[str, FieldValues], required: dict[str, FieldValues]) -> dict:
    """A body in one of three modes: valid fields only; one or two fields at the edge; anything anywhere.
    Edge mode tests each limit alone, so a value that should pass is not hidden by another's 400.
    Outside wild mode a body without max_tokens gets a small one: the server's default (16, or the
    whole context for chat) would make valid requests slow on a CPU."""
    mode = draw(st.sampled_from(["valid", "valid", "edge", "edge", "wild"]))
    names = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=6))
    edge_names = draw(st.lists(st.sampled_from(sorted({**fields, **required})), min_size=1, max_size=2, unique=True)
                      if mode == "edge" else st.just([]))
    body = {}
    for name, values in {**required, **{name: fields[name] for name in names + edge_names if name in fields}}.items():
        if mode == "wild":
            body[name] = draw(st.one_of(values.valid, values.edge, WRONG_TYPE))
        else:
            body[name] = draw(values.edge if name in edge_names else values.valid)
    if mode == "wild":
        for name in draw(st.lists(st.sampled_from(sorted(required)), unique=True)):
            del body[name]   # required fields go missing
        body.update(draw(st.dictionaries(TEXT, WRONG_TYPE, max_size=2)))   # unknown fields are ignored
    elif not {"max_tokens", "max_completion_tokens"} & body.keys():
        body["max_tokens"] = draw(SMALL_MAX_TOKENS)
    return body


def _is_small_int(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value <= limit


def keep_cheap(body: dict, small_max_tokens: int) -> dict:
    """Valid requests must finish in seconds on a CPU: one that may ask for many samples (n or best_of
    over 3, up to MAX_SAMPLES) gets a small max_tokens, under both of chat's names, unless it has one."""
    many = any(not _is_small_int(body.get(name, 1), 3) for name in ("n", "best_of"))
    limits = [name for name in ("max_tokens", "max_completion_tokens") if name in body] or ["max_tokens"]
    if many and not all(_is_small_int(body.get(name), SMALL_MAX_TOKENS_LIMIT) for name in limits):
        body.update(dict.fromkeys(limits, small_max_tokens))
    return body


@dataclass(frozen=True)
class Target:
    """What the strategies need to know of the server under test."""
    model: str
    max_model_len: int
    boundary_chat_tokens: int   # the prompt length of BOUNDARY_CHAT through the chat template

    @classmethod
    def probe(cls, client: httpx.Client, timeout: float) -> Target:
        card = client.get("/v1/models", timeout=timeout).raise_for_status().json()["data"][0]
        tokenized = client.post("/tokenize", json={"messages": BOUNDARY_CHAT}, timeout=timeout).raise_for_status()
        return cls(card["id"], card["max_model_len"], tokenized.json()["count"])

    def models(self) -> FieldValues:
        return FieldValues(st.sampled_from([self.model, None]), TEXT | st.sampled_from([1, ["x"], "gpt-4"]))


def context_boundaries(target: Target) -> list[tuple[str, dict]]:
    """max_tokens exactly filling the context, short of it, or past it: completions of token-id prompts
    that leave 0, 1 or 2 tokens of room, and BOUNDARY_CHAT (greedy: its short answer ends with EOS)."""
    chat_room = target.max_model_len - target.boundary_chat_tokens
    completions = [(COMPLETIONS, {"prompt": [42] * (target.max_model_len - room), "max_tokens": max_tokens})
                   for room in (0, 1, 2) for max_tokens in (1, 2, 3, None)]
    chats = [(CHAT, {"messages": BOUNDARY_CHAT, name: chat_room + extra, "temperature": 0})
             for extra in (0, 1) for name in ("max_tokens", "max_completion_tokens")]
    return completions + chats


# Bodies no client library would build: not JSON, not an object, JSON that Python alone reads (NaN,
# duplicate keys), lone UTF-16 surrogates no tokenizer can encode, nesting past the parser's recursion limit.
RAW_BODIES = [
    b"", b"{", b'{"prompt": "Hi",}', b"\xff\xfe\x00", b"null", b"[]", b'"prompt"', b"42", b"true",
    b'{"prompt": "Hi", "max_tokens": NaN}', b'{"prompt": "Hi", "temperature": Infinity, "max_tokens": 1}',
    b'{"prompt": "Hi", "prompt": 7}', b'{"prompt": "\\ud800", "max_tokens": 1}', b'{"prompt": ["\\udfff"]}',
    b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}",
    b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "Hi", "stop": ["\\ud800"], "max_tokens": 1}',
]


def fixed_requests(target: Target) -> list[tuple[str, Any]]:
    """Cases every run sends, as drawing would not reliably hit each: the context boundaries, and every
    raw body to both endpoints."""
    return context_boundaries(target) + [(path, body) for body in RAW_BODIES for path in (COMPLETIONS, CHAT)]


def drawn_requests(target: Target) -> st.SearchStrategy[tuple[str, Any]]:
    """(path, body) pairs for completions and chat; a body is a JSON object (NaN and Infinity included);
    RAW_BODIES cover the rest."""
    shared = {"model": target.models(), "stream": FieldValues(st.booleans(), st.sampled_from([1, "yes", None]))}
    completion_body = request_bodies(COMPLETION_FIELDS, {"prompt": prompts(target.max_model_len), **shared})
    chat_body = request_bodies(CHAT_FIELDS, {"messages": conversations(), **shared})
    return st.one_of(st.tuples(st.just(COMPLETIONS), st.builds(keep_cheap, completion_body, SMALL_MAX_TOKENS)),
                     st.tuples(st.just(CHAT), st.builds(keep_cheap, chat_body, SMALL_MAX_TOKENS)))


# ---------------------------------------------------------------- what a correct answer is

class _EchoedLogprobs(Logprobs):
    """With echo, nothing scores the first prompt token: its logprob and top logprobs are null, as in
    OpenAI's legacy API and vLLM, which the SDK's types leave out."""
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class _CompletionAnswerChoice(CompletionChoice):
    logprobs: _EchoedLogprobs | None = None


class _CompletionAnswer(Completion):
    choices: list[_CompletionAnswerChoice]


class _CompletionChunkChoice(_CompletionAnswerChoice):
    finish_reason: Literal["stop", "length"] | None = None


class _CompletionChunk(Completion):
    """OpenAI's SDK reads a streamed completion chunk as a Completion without validating it; its
    finish_reason is null until a choice's last chunk."""
    choices: list[_CompletionChunkChoice]


_WHOLE_ANSWER = {COMPLETIONS: _CompletionAnswer, CHAT: ChatCompletion}
_CHUNK = {COMPLETIONS: _CompletionChunk, CHAT: ChatCompletionChunk}


def expected_choices(path: str, body: dict) -> int:
    """n answers per prompt (best_of picks n of its samples); a prompt list holds several prompts."""
    prompt = body.get("prompt")
    several = path == COMPLETIONS and isinstance(prompt, list) and not isinstance(prompt[0], int)
    return body.get("n", 1) * (len(prompt) if several else 1)


def error_body_problem(status: int, text: str) -> str | None:
    """Why a 4xx body is not OpenAI's {"error": {"message", "type", "param", "code"}}, if it is not."""
    try:
        body = json.loads(text)
    except ValueError:
        return "the error body is not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"} or set(error) != {"message", "type", "param", "code"}:
        return 'the error body is not {"error": {"message", "type", "param", "code"}}'
    if not (isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)):
        return "the error's message and type must be non-empty strings"
    if not all(error[key] is None or isinstance(error[key], str) for key in ("param", "code")):
        return "the error's param and code must be strings or null"
    if status == 400 and error["type"] != "invalid_request_error":
        return f"a 400's type must be invalid_request_error, got {error['type']!r}"
    return None


def answer_problem(path: str, body: dict, text: str, streamed: bool) -> str | None:
    """Why a 2xx answer is not what the request asked for: OpenAI's shape (per the official SDK's
    types), a finished choice for each of n answers per prompt, consistent usage."""
    try:
        if streamed:
            finished = _stream_finished_choices(path, text)
        else:
            answer = _WHOLE_ANSWER[path].model_validate_json(text)
            finished = {choice.index for choice in answer.choices}
            usage = answer.usage
            if usage is None or usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
                return f"usage is missing or does not add up: {usage}"
    except ValueError as exc:   # pydantic's ValidationError and json's JSONDecodeError are ValueErrors
        return f"the answer is not OpenAI's shape: {_cut(str(exc))}"
    want = expected_choices(path, body)
    if finished != set(range(want)):
        return f"expected {want} finished choices, got indices {sorted(finished)}"
    return None


def _stream_finished_choices(path: str, text: str) -> set[int]:
    """The indices of the choices a Server-Sent Events stream finishes; ValueError if it is malformed,
    carries an error event or does not end with `data: [DONE]`."""
    events = [line for line in text.splitlines() if line]
    if not events or events[-1] != "data: [DONE]":
        raise ValueError("the stream does not end with data: [DONE]")
    finished = set()
    for event in events[:-1]:
        if not event.startswith("data: "):
            raise ValueError(f"not a data event: {event!r}")
        data = json.loads(event.removeprefix("data: "))
        if isinstance(data, dict) and "error" in data:
            raise ValueError(f"the stream failed after its 200: {event}")
        chunk = _CHUNK[path].model_validate(data)
        finished |= {choice.index for choice in chunk.choices if choice.finish_reason}
    return finished


# ---------------------------------------------------------------- running

class _Hang(Exception):
    """The server took longer than the request timeout to answer in full."""


def _exchange(client: httpx.Client, path: str, content: bytes, timeout: float) -> tuple[int, str]:
    """The status and whole body, read against one deadline (a stream that trickles on is a hang too)."""
    deadline = time.monotonic() + timeout
    with client.stream("POST", path, content=content, timeout=timeout) as response:
        parts = []
        for part in response.iter_text():
            parts.append(part)
            if time.monotonic() > deadline:
                raise _Hang
        return response.status_code, "".join(parts)


def _no_answer(result: FuzzResult, shown: str, timeout: float, connection_error: Exception | None = None) -> None:
    """A request that got no answer: a hang (timed out) or a dropped connection (a crash?)."""
    result.count("no answer")
    problem = (f"no answer within {timeout}s (a hang)" if connection_error is None
               else f"connection failed (the server crashed?): {connection_error!r}")
    result.violations.append(f"{shown} -> {problem}")


def _sent_object(content: bytes) -> dict | None:
    """The body as the server's JSON parser reads it (NaN literals too), if it is an object."""
    try:
        value = json.loads(content)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def fire(client: httpx.Client, path: str, body: Any, timeout: float, result: FuzzResult) -> None:
    """Sends one request and records its outcome and any violation."""
    content = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    shown = f"POST {path} {_cut(content.decode(errors='replace'))}"
    try:
        status, text = _exchange(client, path, content, timeout)
    except (httpx.TimeoutException, _Hang):
        _no_answer(result, shown, timeout)
        return
    except httpx.TransportError as exc:
        _no_answer(result, shown, timeout, exc)
        return
    result.count(_status_class(status))
    sent = _sent_object(content)
    if 200 <= status < 300 and sent is None:
        problem = "a 2xx for a body that is not a JSON object"
    elif 200 <= status < 300:
        problem = answer_problem(path, sent, text, streamed=sent.get("stream") is True)
    elif 400 <= status < 500:
        problem = error_body_problem(status, text)
    else:
        problem = f"status {status}"
    if problem is not None:
        result.violations.append(f"{shown} -> {status} {_cut(text)}: {problem}")


def _run_examples(strategy: st.SearchStrategy, action: Callable[[Any], None], max_examples: int, seed: int) -> None:
    """Calls action on max_examples draws, outside pytest. Nothing raises, so there is nothing to shrink."""
    @hypothesis.seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def run(example: Any) -> None:
        action(example)

    run()


def check_recovered(client: httpx.Client, result: FuzzResult, idle_timeout: float, timeout: float) -> None:
    """After fuzzing the server must still answer, and once idle have every KV block back in its pool."""
    deadline = time.monotonic() + idle_timeout
    try:
        while True:
            response = client.get("/metrics", timeout=timeout)
            response.raise_for_status()
            figures = EngineFigures(response.text)
            if figures.idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except httpx.HTTPError as exc:
        result.violations.append(f"after fuzzing the server does not answer GET /metrics: {exc!r}")
        return
    if not figures.idle:
        result.violations.append(
            f"{idle_timeout}s after fuzzing the engine is not idle: {figures.running:.0f} running, "
            f"{figures.waiting:.0f} waiting, {figures.free_blocks:.0f} of {figures.total_blocks:.0f} KV blocks free")


def run_fuzz(url: str, headers: dict, max_examples: int, seed: int, request_timeout: float,
             idle_timeout: float = IDLE_TIMEOUT) -> FuzzResult:
    """Sends the fixed requests and max_examples hypothesis-drawn completion and chat requests to the
    server, one at a time, then checks that it recovered (see check_recovered)."""
    result = FuzzResult()
    started = time.monotonic()
    with httpx.Client(base_url=url, headers={**headers, "Content-Type": "application/json"}) as client:
        try:
            target = Target.probe(client, request_timeout)
        except (httpx.HTTPError, ValueError, LookupError) as exc:
            result.violations.append(f"the server does not describe itself (GET /v1/models, POST /tokenize): {exc!r}")
        else:
            for path, body in fixed_requests(target):
                fire(client, path, body, request_timeout, result)
            _run_examples(drawn_requests(target), lambda request: fire(client, *request, request_timeout, result),
                          max_examples, seed)
            check_recovered(client, result, idle_timeout, request_timeout)
    result.elapsed_s = time.monotonic() - started
    return result


# ---------------------------------------------------------------- schemathesis

# Checks whose rules the schema can state; positive_data_acceptance is left out: the schema does not
# encode cross-field rules (best_of >= n, prompt + max_tokens <= max_model_len), so valid-looking data gets 400s.
SCHEMATHESIS_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
                       response_schema_conformance, negative_data_rejection]


def _call_and_check(case: schemathesis.Case, url: str, headers: dict, timeout: float, result: FuzzResult) -> None:
    shown = f"{case.operation.label} {_cut(repr(case.body))}"
    try:
        response = case.call(base_url=url, headers=headers, timeout=timeout)
    except requests.Timeout:
        _no_answer(result, shown, timeout)
        return
    except requests.ConnectionError as exc:
        _no_answer(result, shown, timeout, exc)
        return
    result.count(_status_class(response.status_code))
    try:
        case.validate_response(response, checks=SCHEMATHESIS_CHECKS, headers=headers)
    except FailureGroup as group:
        titles = "; ".join(failure.title for failure in group.exceptions)
        result.violations.append(f"{shown} -> {response.status_code} {_cut(response.text)}: {titles}")


def run_schemathesis(url: str, headers: dict, max_examples: int, seed: int = 0,
                     request_timeout: float = 60.0, path_prefixes: tuple[str, ...] = ("/",)) -> FuzzResult:
    """schemathesis over the server's own /openapi.json: max_examples schema-valid and max_examples
    schema-invalid cases per operation (those under path_prefixes), each answer checked against the
    schema (SCHEMATHESIS_CHECKS)."""
    result = FuzzResult()
    started = time.monotonic()
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers, timeout=request_timeout)
    for loaded in schema.get_all_operations():
        if not isinstance(loaded, Ok):
            result.violations.append(f"an operation of the schema cannot be tested: {loaded.err()}")
            continue
        operation = loaded.ok()
        if not operation.path.startswith(path_prefixes):
            continue
        for mode in GenerationMode:
            try:
                _run_examples(operation.as_strategy(generation_mode=mode),
                              lambda case: _call_and_check(case, url, headers, request_timeout, result),
                              max_examples, seed)
            except Unsatisfiable:
                if mode is GenerationMode.POSITIVE:
                    raise
                # an operation without parameters or body (GET /health) has nothing to make invalid
    result.elapsed_s = time.monotonic() - started
    return result
