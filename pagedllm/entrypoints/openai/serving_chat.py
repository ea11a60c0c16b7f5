"""POST /v1/chat/completions: the conversation through the model's chat template, n answers."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response

from pagedllm.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_field
from pagedllm.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse, ChatResponseMessage, ChatStreamChoice,
                                                  DeltaMessage)
from pagedllm.entrypoints.openai.request_fields import check_undeclared_fields
from pagedllm.entrypoints.openai.serving_engine import (ChoiceState, ServerState, collect_choices, has_news,
                                                        usage)
from pagedllm.entrypoints.openai.streams import SSE_DONE, sse_error, sse_event, sse_response, unless_disconnected
from pagedllm.outputs import RequestOutput


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request,
                                 state: ServerState) -> Response | ChatCompletionResponse:
    check_undeclared_fields(body)
    state.check_model(body.model)
    params = body.to_sampling_params()
    prompt_ids = state.chat_prompt_ids(body.messages, body.add_generation_prompt)
    prompt = state.engine_prompt(prompt_ids, None, params, param="messages",
                                 cache_salt=state.cache_salt(raw_request, body.cache_salt))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    merged = state.generate([prompt], params, [request_id])
    if body.stream:
        return sse_response(_stream(body, request_id, len(prompt_ids), params.n, merged, state))
    rows = await unless_disconnected(raw_request, collect_choices(merged, 1, params.n))
    if rows is None:
        return Response(status_code=499)   # the client left; nobody reads this
    choices = rows[0]
    num_top = body.top_logprobs or 0
    return ChatCompletionResponse(
        id=request_id, model=state.model_name, system_fingerprint=state.system_fingerprint,
        usage=usage([len(prompt_ids)], choices),
        prompt_logprobs=prompt_logprobs_field(choices[0].prompt_logprobs),
        choices=[ChatChoice(index=index, message=ChatResponseMessage(content=choice.text),
                            logprobs=chat_logprobs(choice.token_ids, choice.logprobs, num_top) if body.logprobs
                            else None,
                            finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
                 for index, choice in enumerate(choices)])


async def _stream(body: ChatCompletionRequest, request_id: str, num_prompt_tokens: int, n: int,
                  merged: AsyncIterator[tuple[int, RequestOutput]], state: ServerState) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], **fields) -> str:
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=state.model_name,
                                             choices=choices, system_fingerprint=state.system_fingerprint,
                                             **fields))

    choices = [ChoiceState() for _ in range(n)]
    num_top = body.top_logprobs or 0
    try:
        # As OpenAI: each choice opens with the role, before any text.
        for index in range(n):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        prompt_logprobs = None   # when asked: from the first output, sent with the first chunk after it
        async for _, output in merged:
            if output.prompt_logprobs is not None:
                prompt_logprobs = prompt_logprobs_field(output.prompt_logprobs)
            for delta in output.outputs:
                choice = choices[delta.index]
                if not has_news(choice, delta):
                    continue
                choice.add(delta)
                logprobs = chat_logprobs(delta.token_ids, delta.logprobs or [], num_top) if body.logprobs else None
                yield chunk([ChatStreamChoice(index=delta.index, delta=DeltaMessage(content=delta.text),
                                              logprobs=logprobs, finish_reason=delta.finish_reason,
                                              stop_reason=delta.stop_reason)], prompt_logprobs=prompt_logprobs)
                prompt_logprobs = None
        if body.include_usage:
            yield chunk([], usage=usage([num_prompt_tokens], choices))
    except Exception as exc:
        yield sse_error(exc, request_id)
    yield SSE_DONE
