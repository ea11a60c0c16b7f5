"""What a correct answer to a fuzzed request is: a 2xx of the documented shape (read with the official openai
client's types) with the choices the body asked for, or a 4xx with OpenAI's error body."""
from __future__ import annotations

import json
from typing import Literal

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs

from benchmarks.reliability.fuzz_requests import CHAT, COMPLETIONS

SHOWN = 300   # characters of a request or an answer kept in a violation


def cut(text: str) -> str:
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


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
        return f"the answer is not OpenAI's shape: {cut(str(exc))}"
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
