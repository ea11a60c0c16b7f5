"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API). Each request runs as the
chat request it translates to; errors on these routes come in Anthropic's shape (errors.py)."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response

from pagedllm.entrypoints.anthropic.events import MessageBuilder
from pagedllm.entrypoints.anthropic.protocol import (ANTHROPIC_ERROR_RESPONSES, CountTokensRequest,
                                                     CountTokensResponse, MessageResponse, MessagesRequest)
from pagedllm.entrypoints.anthropic.translate import MESSAGES_NAMES, cache_breakpoints, chat_request
from pagedllm.entrypoints.openai.answer_segments import streamed_events, whole_answer
from pagedllm.entrypoints.openai.errors import ANTHROPIC_PATH_PREFIX, APIError, error_body
from pagedllm.entrypoints.openai.request_fields import check_undeclared_fields
from pagedllm.entrypoints.openai.serving_chat import ChatRun, start_chat
from pagedllm.entrypoints.openai.serving_engine import ServerState
from pagedllm.entrypoints.openai.streams import mid_stream_error, sse_response, sse_typed_event
from pagedllm.entrypoints.openai.tool_requests import tool_choice_mode
from pagedllm.entrypoints.openai.translated_requests import renamed

router = APIRouter()
_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "Server-Sent Events: message_start, "
                                                                               "content_block_*, message_delta, "
                                                                               "message_stop, ping"}}}


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.post("/v1/messages", responses={200: {"model": MessageResponse, "content": _STREAM},
                                        **ANTHROPIC_ERROR_RESPONSES})
async def create_message(body: MessagesRequest, raw_request: Request):
    state = _state(raw_request)
    check_undeclared_fields(body)
    try:
        run = start_chat(chat_request(body), raw_request, state, f"msg_{uuid.uuid4().hex}",
                         cache_breakpoints(body))
    except APIError as error:
        raise renamed(error, MESSAGES_NAMES) from error
    builder = MessageBuilder(MessageResponse(id=run.request_id, model=run.model_name,
                                             usage={"input_tokens": len(run.prompt_ids), "output_tokens": 0}))
    if body.stream:
        return sse_response(_stream(run, builder))
    answer = await whole_answer(raw_request, run.merged, run.new_parser())
    if answer is None:
        return Response(status_code=499)   # the client left; nobody reads this
    builder.take(answer, len(run.prompt_ids))
    return builder.message


async def _stream(run: ChatRun, builder: MessageBuilder) -> AsyncIterator[str]:
    try:
        async for event in streamed_events(run.merged, run.new_parser(), builder, len(run.prompt_ids)):
            yield sse_typed_event(event)
    except Exception as exc:
        error = mid_stream_error(exc, run.request_id)
        yield sse_typed_event(error_body(error.status, error.message, error.param, error.code, ANTHROPIC_PATH_PREFIX))


@router.post("/v1/messages/count_tokens", responses=ANTHROPIC_ERROR_RESPONSES)
async def count_tokens(body: CountTokensRequest, raw_request: Request) -> CountTokensResponse:
    """The prompt's tokens as /v1/messages would send them to the model: template, system and tools included."""
    state = _state(raw_request)
    check_undeclared_fields(body)
    state.resolve_model(body.model)
    try:
        chat = chat_request(body)
        cache_breakpoints(body)   # refused as /v1/messages would refuse them
        mode = tool_choice_mode(chat.tools, chat.tool_choice, state.enable_auto_tool_choice)
    except APIError as error:
        raise renamed(error, MESSAGES_NAMES) from error
    tools = chat.tools if mode != "none" else None
    return CountTokensResponse(input_tokens=len(state.chat_prompt_ids(chat.messages, tools=tools)))
