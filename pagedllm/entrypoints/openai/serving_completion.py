"""POST /v1/completions: one engine request per prompt, n choices (or n beams) each, streamed or whole."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.logprobs import completion_logprobs
from pagedllm.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from pagedllm.entrypoints.openai.serving_engine import (ChoiceState, ServerState, collect_choices, has_news,
                                                        usage)
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


async def create_completion(body: CompletionRequest, raw_request: Request, state: ServerState) -> Response | dict:
    state.check_model(body.model)
    params = body.to_sampling_params()
    cache_salt = state.cache_salt(raw_request, body.cache_salt)
    prompts = [state.engine_prompt(ids, text, params, param="prompt", cache_salt=cache_salt)
               for text, ids in _prompt_inputs(body.prompt, state.tokenizer)]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    merged = state.generate(prompts, params, [f"{request_id}-{index}" for index in range(len(prompts))])
    if body.stream:
        return sse_response(_stream(body, request_id, prompts, body.n, merged, state))
    choices = await unless_disconnected(raw_request, collect_choices(merged, len(prompts), body.n))
    if choices is None:
        return Response(status_code=499)   # the client left; nobody reads this
    response = CompletionResponse(id=request_id, model=state.model_name, choices=[],
                                  system_fingerprint=state.system_fingerprint,
                                  usage=usage([len(p["prompt_token_ids"]) for p in prompts],
                                              [choice for row in choices for choice in row]))
    for prompt_index, (prompt, row) in enumerate(zip(prompts, choices)):
        prefix = _echo_text(prompt, state) if body.echo else ""
        for index, choice in enumerate(row):
            logprobs = None if body.logprobs is None else completion_logprobs(choice.token_ids, choice.logprobs,
                                                                              len(prefix))
            response.choices.append(CompletionChoice(
                index=prompt_index * body.n + index, text=prefix + choice.text, logprobs=logprobs,
                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason))
    return response


async def _stream(body: CompletionRequest, request_id: str, prompts: list[dict], n: int,
                  merged: AsyncIterator[tuple[int, RequestOutput]], state: ServerState) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], **fields) -> str:
        return sse_event(CompletionResponse(id=request_id, created=created, model=state.model_name, choices=choices,
                                            system_fingerprint=state.system_fingerprint, **fields))

    choices = [[ChoiceState() for _ in range(n)] for _ in prompts]
    text_offsets = [[0] * n for _ in prompts]   # where each choice's next token starts in its text
    try:
        async for prompt_index, output in merged:
            for delta in output.outputs:
                choice = choices[prompt_index][delta.index]
                if not has_news(choice, delta):
                    continue
                prefix = ""
                if body.echo and not choice.token_ids:
                    prefix = _echo_text(prompts[prompt_index], state)
                    text_offsets[prompt_index][delta.index] = len(prefix)
                choice.add(delta)
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(delta.token_ids, delta.logprobs or [],
                                                   text_offsets[prompt_index][delta.index])
                    if logprobs.tokens:
                        text_offsets[prompt_index][delta.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                yield chunk([CompletionChoice(index=prompt_index * n + delta.index, text=prefix + delta.text,
                                              logprobs=logprobs, finish_reason=delta.finish_reason,
                                              stop_reason=delta.stop_reason)])
        if body.include_usage:
            yield chunk([], usage=usage([len(p["prompt_token_ids"]) for p in prompts],
                                        [choice for row in choices for choice in row]))
    except Exception as exc:
        yield sse_error(exc, request_id)
    yield SSE_DONE
