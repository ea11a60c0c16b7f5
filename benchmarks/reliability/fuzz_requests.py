"""What the fuzzer sends: hypothesis strategies for completion and chat bodies (odd Unicode, sampling fields at
and past their limits, wrong types, missing fields), the requests at the context's end, and raw bodies no client
library would build."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

from pagedllm.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_SAMPLES

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# A conversation whose prompt length run_fuzz measures, so max_tokens can be drawn exactly at the context's end.
BOUNDARY_CHAT = [{"role": "user", "content": "Hi"}]

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
