"""POST /v1/completions: one engine request per prompt, n choices (or n beams) each, streamed or whole."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.logprobs import completion_logprobs, echoed_completion_logprobs, prompt_logprobs_field
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.response_protocol import CompletionChoice, CompletionLogprobs, CompletionResponse
from pagedllm.entrypoints.openai.request_fields import check_undeclared_fields
from pagedllm.entrypoints.openai.serving_engine import (ChoiceState, ServerState, collect_choices, has_news,
                                                        note_prompt_facts, usage)
from pagedllm.entrypoints.openai.streams import SSE_DONE, sse_error, sse_event, sse_response, unless_disconnected
from pagedllm.outputs import RequestOutput
from pagedllm.tokenizer import Tokenizer


def _prompt_inputs(prompt: str | list, tokenizer: Tokenizer) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) of each prompt: a string, a list of strings, token ids or a list of those."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        prompt = [prompt]
    return [(item, tokenizer.encode(item)) if isinstance(item, str) else (None, item) for item in prompt]


def _echo_text(prompt: dict, state: ServerState) -> str:
    return prompt.get("prompt") or state.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)


def _choice_logprobs(body: CompletionRequest, prompt: dict, choice: ChoiceState, text_offset: int,
                     state: ServerState) -> CompletionLogprobs | None:
    """The legacy logprobs of a choice (or of a streamed delta): with echo, its prompt's come first."""
    if body.logprobs is None:
        return None
    if not body.echo or choice.prompt_logprobs is None:
        return completion_logprobs(choice.token_ids, choice.logprobs, text_offset,
                                   bool(body.return_tokens_as_token_ids))
    prompt_ids = prompt["prompt_token_ids"]
    first = state.tokenizer.decode(prompt_ids[:1], skip_special_tokens=False)
    return echoed_completion_logprobs(prompt_ids, choice.prompt_logprobs, first, choice.token_ids, choice.logprobs,
                                      bool(body.return_tokens_as_token_ids))


def _drop_generated(choice: ChoiceState) -> None:
    """echo with max_tokens 0: the token generated to get there is not part of the answer."""
    choice.text, choice.token_ids, choice.logprobs = "", [], []
    choice.finish_reason, choice.stop_reason = "length", None


async def create_completion(body: CompletionRequest, raw_request: Request, state: ServerState) -> Response | dict:
    check_undeclared_fields(body)
    adapter = state.resolve_model(body.model)
    model_name = state.reported_model_name(adapter)
    params = body.to_sampling_params()
    cache_salt = state.cache_salt(raw_request, body.cache_salt)
    prompts = [state.engine_prompt(ids, text, params, param="prompt", cache_salt=cache_salt)
               for text, ids in _prompt_inputs(body.prompt, state.tokenizer)]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    merged = state.generate(prompts, params, [f"{request_id}-{index}" for index in range(len(prompts))],
                            body.priority, lora_request=adapter)
    if body.stream:
        return sse_response(_stream(body, request_id, model_name, prompts, body.n, merged, state))
    choices = await unless_disconnected(raw_request, collect_choices(merged, len(prompts), body.n))
    if choices is None:
        return Response(status_code=499)   # the client left; nobody reads this
    if body.echo_only:
        for choice in (choice for row in choices for choice in row):
            _drop_generated(choice)
    response = CompletionResponse(id=request_id, model=model_name, choices=[],
                                  system_fingerprint=state.system_fingerprint,
                                  usage=usage([len(p["prompt_token_ids"]) for p in prompts], choices))
    for prompt_index, (prompt, row) in enumerate(zip(prompts, choices)):
        prefix = _echo_text(prompt, state) if body.echo else ""
        for index, choice in enumerate(row):
            response.choices.append(CompletionChoice(
                index=prompt_index * body.n + index, text=prefix + choice.text,
                logprobs=_choice_logprobs(body, prompt, choice, len(prefix), state),
                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                prompt_logprobs=prompt_logprobs_field(choice.prompt_logprobs) if body.prompt_logprobs is not None
                else None))
    return response


async def _stream(body: CompletionRequest, request_id: str, model_name: str, prompts: list[dict], n: int,
                  merged: AsyncIterator[tuple[int, RequestOutput]], state: ServerState) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], **fields) -> str:
        return sse_event(CompletionResponse(id=request_id, created=created, model=model_name, choices=choices,
                                            system_fingerprint=state.system_fingerprint, **fields))

    choices = [[ChoiceState() for _ in range(n)] for _ in prompts]
    text_offsets = [[0] * n for _ in prompts]   # where each choice's next token starts in its text
    prompt_logprobs = [None] * len(prompts)     # each prompt's, from its first output (when asked)
    try:
        async for prompt_index, output in merged:
            if output.prompt_logprobs is not None:
                prompt_logprobs[prompt_index] = output.prompt_logprobs
            note_prompt_facts(choices[prompt_index], output)
            for delta in output.outputs:
                choice = choices[prompt_index][delta.index]
                if not has_news(choice, delta):
                    continue
                first = not choice.token_ids
                choice.add(delta)
                # This chunk's part of the choice: the delta, after the echoed prompt in the first chunk.
                part = ChoiceState(text=delta.text, token_ids=delta.token_ids, logprobs=delta.logprobs or [],
                                   finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                   prompt_logprobs=prompt_logprobs[prompt_index] if first else None)
                if body.echo_only:
                    _drop_generated(part)
                prefix = ""
                if body.echo and first:
                    prefix = _echo_text(prompts[prompt_index], state)
                    text_offsets[prompt_index][delta.index] = len(prefix)
                logprobs = _choice_logprobs(body, prompts[prompt_index], part, text_offsets[prompt_index][delta.index],
                                            state)
                if logprobs is not None and logprobs.tokens:
                    text_offsets[prompt_index][delta.index] = logprobs.end_offset
                yield chunk([CompletionChoice(
                    index=prompt_index * n + delta.index, text=prefix + part.text, logprobs=logprobs,
                    finish_reason=part.finish_reason, stop_reason=part.stop_reason,
                    prompt_logprobs=prompt_logprobs_field(part.prompt_logprobs) if body.prompt_logprobs is not None
                    else None)])
        if body.include_usage:
            if body.echo_only:
                for choice in (choice for row in choices for choice in row):
                    _drop_generated(choice)
            yield chunk([], usage=usage([len(p["prompt_token_ids"]) for p in prompts], choices))
    except Exception as exc:
        yield sse_error(exc, request_id)
    yield SSE_DONE
