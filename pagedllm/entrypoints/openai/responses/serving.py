"""POST /v1/responses (OpenAI's Responses API) and its stored responses: GET / DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel. Each request runs as the chat request it translates to."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response

from pagedllm.entrypoints.openai.answer_segments import streamed_events, whole_answer
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.response_protocol import ERROR_RESPONSES
from pagedllm.entrypoints.openai.request_fields import check_undeclared_fields
from pagedllm.entrypoints.openai.responses.events import ResponseBuilder
from pagedllm.entrypoints.openai.responses.protocol import (DeletedResponse, OutputFunctionCall, OutputMessage,
                                                            ResponseObject, ResponsesRequest)
from pagedllm.entrypoints.openai.responses.store import ResponseStore
from pagedllm.entrypoints.openai.responses.translate import (RESPONSES_NAMES, chat_request, check_refused,
                                                             input_messages)
from pagedllm.entrypoints.openai.serving_chat import ChatRun, start_chat
from pagedllm.entrypoints.openai.serving_engine import ServerState
from pagedllm.entrypoints.openai.streams import mid_stream_error, sse_response, sse_typed_event
from pagedllm.entrypoints.openai.translated_requests import renamed

router = APIRouter()
_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "Server-Sent Events: the typed "
                                                                               "response.* events"}}}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _store(request: Request) -> ResponseStore:
    """The app's store of responses (build_app makes it, beside the ServerState every endpoint shares)."""
    return request.app.state.response_store


def _tenant(request: Request) -> str | None:
    return getattr(request.state, "tenant", None)


@router.post("/v1/responses", responses={200: {"model": ResponseObject, "content": _STREAM}, **ERROR_RESPONSES})
async def create_response(body: ResponsesRequest, raw_request: Request):
    state = _state(raw_request)
    check_undeclared_fields(body)
    check_refused(body)
    history: list[dict] = []
    if body.previous_response_id is not None:
        previous = _store(raw_request).get(body.previous_response_id, _tenant(raw_request))
        if previous is None:
            raise APIError(404, f"no stored response {body.previous_response_id!r} (it was never stored, was "
                                "deleted, or has expired)", param="previous_response_id", code="response_not_found")
        history = previous.conversation
    conversation = history + input_messages(body.input)
    request_id = f"resp_{uuid.uuid4().hex}"
    try:
        run = start_chat(chat_request(body, conversation), raw_request, state, request_id)
    except APIError as error:
        raise renamed(error, RESPONSES_NAMES) from error
    builder = ResponseBuilder(_echo(body, request_id, run.model_name), lambda text: len(state.tokenizer.encode(text)))
    if body.stream:
        return sse_response(_stream(body, run, builder, conversation, raw_request))
    answer = await whole_answer(raw_request, run.merged, run.new_parser())
    if answer is None:
        return Response(status_code=499)   # the client left; nobody reads this
    builder.take(answer, len(run.prompt_ids))
    _keep(body, builder.response, conversation, raw_request)
    return builder.response


def _echo(body: ResponsesRequest, response_id: str, model_name: str) -> ResponseObject:
    """The response before its output: the request's settings, as OpenAI echoes them."""
    text = body.text.model_dump(mode="json", by_alias=True, exclude_none=True) if body.text else None
    return ResponseObject(
        id=response_id, status="in_progress", model=model_name, instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        tools=[tool.model_dump(mode="json", exclude_none=True) for tool in body.tools or []],
        tool_choice=(body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
                     else body.tool_choice or ("auto" if body.tools else "none")),
        parallel_tool_calls=body.parallel_tool_calls, text=text or {"format": {"type": "text"}},
        reasoning=body.reasoning.model_dump() if body.reasoning else None, metadata=body.metadata or {},
        user=body.user, store=body.store, previous_response_id=body.previous_response_id)


async def _stream(body: ResponsesRequest, run: ChatRun, builder: ResponseBuilder, conversation: list[dict],
                  raw_request: Request) -> AsyncIterator[str]:
    for event in builder.start():
        yield sse_typed_event(event)
    try:
        async for event in streamed_events(run.merged, run.new_parser(), builder, len(run.prompt_ids)):
            yield sse_typed_event(event)
    except Exception as exc:
        error = mid_stream_error(exc, run.request_id)
        for event in builder.fail(error.code or "server_error", error.message):
            yield sse_typed_event(event)
        return
    _keep(body, builder.response, conversation, raw_request)


def _keep(body: ResponsesRequest, response: ResponseObject, conversation: list[dict], raw_request: Request) -> None:
    """store: the response, and the conversation a later previous_response_id continues."""
    if body.store:
        _store(raw_request).put(response, conversation + [_answer_message(response)], _tenant(raw_request))


def _answer_message(response: ResponseObject) -> dict:
    """The response's output as the assistant's chat message (reasoning is not carried on)."""
    text = "".join(part.text for item in response.output if isinstance(item, OutputMessage) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in response.output if isinstance(item, OutputFunctionCall)]
    return {"role": "assistant", "content": text if text or not calls else None, **({"tool_calls": calls} if calls
                                                                                    else {})}


def _stored(request: Request, response_id: str):
    entry = _store(request).get(response_id, _tenant(request))
    if entry is None:
        raise APIError(404, f"no stored response {response_id!r}", param="response_id", code="response_not_found")
    return entry


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def retrieve_response(response_id: str, request: Request) -> ResponseObject:
    return _stored(request, response_id).response


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    _stored(request, response_id)
    _store(request).delete(response_id, _tenant(request))
    return DeletedResponse(id=response_id)


@router.post("/v1/responses/{response_id}/cancel", responses=ERROR_RESPONSES)
async def cancel_response(response_id: str, request: Request) -> ResponseObject:
    """Only background responses can be cancelled, and this server runs none (background is refused):
    a stored response has finished."""
    _stored(request, response_id)
    raise APIError(400, f"response {response_id!r} cannot be cancelled: only background responses can be, and "
                        "this server runs none in the background (close a stream to stop an answer)",
                   param="response_id")
