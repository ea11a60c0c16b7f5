"""POST /v1/chat/completions: the conversation through the chat template, n answers, each read by the
reasoning parser and the tool choice into content, reasoning_content and tool_calls."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from fastapi import Request, Response

from pagedllm.entrypoints.openai.chat_output import ChoiceParser, ParsedDelta, whole_tool_calls
from pagedllm.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_field
from pagedllm.engine.request import CachePin
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.response_protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse,
                                                           ChatResponseMessage, ChatStreamChoice, DeltaMessage)
from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedllm.entrypoints.openai.request_fields import check_undeclared_fields
from pagedllm.entrypoints.openai.serving_engine import (ChoiceState, ServerState, collect_choices, has_news,
                                                        note_prompt_facts, usage)
from pagedllm.entrypoints.openai.streams import SSE_DONE, sse_error, sse_event, sse_response, unless_disconnected
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.openai.tool_requests import ChatCompletionTool, forced_tool_schema, tool_choice_mode
from pagedllm.outputs import RequestOutput


@dataclass
class ChatRun:
    """A chat request on its way through the engine: what chat shares with the Responses and Messages
    APIs, which translate their requests into chat requests."""
    request_id: str
    model_name: str   # what the answer reports: the adapter's name, or the base model's
    prompt_ids: list[int]
    merged: AsyncIterator[tuple[int, RequestOutput]]
    new_parser: Callable[[], ChoiceParser]   # one per choice: reasoning, then tool calls apart from content


@dataclass(frozen=True)
class CacheBreakpoint:
    """The conversation cut after a block marked to keep cached (Anthropic's cache_control), for ttl_s seconds."""
    messages: list[ChatMessage]
    tools: list[ChatCompletionTool]
    ttl_s: float
    field: str   # the request field that marked it, for errors


def _cache_pins(breakpoints: Sequence[CacheBreakpoint], prompt_ids: list[int], body: ChatCompletionRequest,
                tools: list[ChatCompletionTool] | None, state: ServerState) -> list[CachePin]:
    """Each breakpoint's prefix of the prompt: the tokens its cut conversation renders to that the whole prompt
    starts with too (where a template puts a part elsewhere, such as tools after the system prompt, the prefix
    ends where the two part). A cut the template cannot render alone (no messages) marks no tokens."""
    pins = []
    for breakpoint in breakpoints:
        try:
            prefix_ids = state.chat_prompt_ids(breakpoint.messages, False, breakpoint.tools if tools else None,
                                               body.chat_template_kwargs)
        except APIError:
            prefix_ids = []
        shared = next((index for index, (ours, whole) in enumerate(zip(prefix_ids, prompt_ids)) if ours != whole),
                      min(len(prefix_ids), len(prompt_ids)))
        pins.append(CachePin(shared, breakpoint.ttl_s))
    return pins


def start_chat(body: ChatCompletionRequest, raw_request: Request, state: ServerState, request_id: str,
               cache_breakpoints: Sequence[CacheBreakpoint] = ()) -> ChatRun:
    """Checks the request (a 400 naming the field at fault) and hands it to the engine, with the prompt prefixes
    that cache_breakpoints mark to keep cached."""
    check_undeclared_fields(body)
    adapter = state.resolve_model(body.model)
    tool_mode = tool_choice_mode(body.tools, body.tool_choice, state.enable_auto_tool_choice)
    tools = body.tools if tool_mode != "none" else None   # "none": the template does not offer them either
    params = body.to_sampling_params(forced_tool_schema(tools, tool_mode, body.parallel_tool_calls) if tools else None)
    prompt_ids = state.chat_prompt_ids(body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs)
    if cache_breakpoints and not state.llm.config.enable_prefix_caching:
        raise APIError(400, f"{cache_breakpoints[0].field}: keeping a prefix cached needs the prefix cache, which "
                            "this server runs without (--no-enable-prefix-caching); leave cache_control out",
                       param=cache_breakpoints[0].field)
    prompt = state.engine_prompt(prompt_ids, None, params, param="messages",
                                 cache_salt=state.cache_salt(raw_request, body.cache_salt),
                                 cache_pins=_cache_pins(cache_breakpoints, prompt_ids, body, tools, state))
    merged = state.generate([prompt], params, [request_id], body.priority, lora_request=adapter)

    def new_parser() -> ChoiceParser:
        reasoning = REASONING_PARSERS[state.reasoning_parser]() if state.reasoning_parser else None
        tool_parser = TOOL_PARSERS[state.tool_call_parser]() if tool_mode == "auto" else None
        return ChoiceParser(reasoning, tool_mode, tool_parser, parallel_tool_calls=body.parallel_tool_calls)

    return ChatRun(request_id, state.reported_model_name(adapter), prompt_ids, merged, new_parser)


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request,
                                 state: ServerState) -> Response | ChatCompletionResponse:
    run = start_chat(body, raw_request, state, f"chatcmpl-{uuid.uuid4().hex}")
    if body.stream:
        return sse_response(_stream(body, run, state))
    rows = await unless_disconnected(raw_request, collect_choices(run.merged, 1, body.n))
    if rows is None:
        return Response(status_code=499)   # the client left; nobody reads this
    choices = rows[0]
    num_top = body.top_logprobs or 0
    return ChatCompletionResponse(
        id=run.request_id, model=run.model_name, system_fingerprint=state.system_fingerprint,
        usage=usage([len(run.prompt_ids)], [choices]),
        prompt_logprobs=prompt_logprobs_field(choices[0].prompt_logprobs),
        choices=[_whole_choice(index, choice, run.new_parser(), body, num_top) for index, choice in enumerate(choices)])


def _whole_choice(index: int, choice: ChoiceState, parser: ChoiceParser, body: ChatCompletionRequest,
                  num_top: int) -> ChatChoice:
    parts = parser.feed(choice.text)
    parts.extend(parser.finish())
    tool_calls = whole_tool_calls(parts.tool_calls)
    message = ChatResponseMessage(content=parts.content if parts.content or not tool_calls else None,
                                  reasoning_content=_reasoning(parts, parser, body), tool_calls=tool_calls)
    logprobs = (chat_logprobs(choice.token_ids, choice.logprobs, num_top, bool(body.return_tokens_as_token_ids))
                if body.logprobs else None)
    return ChatChoice(index=index, message=message, logprobs=logprobs,
                      finish_reason=_finish_reason(choice.finish_reason, parser),
                      stop_reason=choice.stop_reason)


def _reasoning(parts: ParsedDelta, parser: ChoiceParser, body: ChatCompletionRequest) -> str | None:
    return parts.reasoning if parser.reasoned and body.include_reasoning else None


def _finish_reason(finish_reason: str | None, parser: ChoiceParser) -> str | None:
    """OpenAI's "tool_calls" when the answer ended by calling tools."""
    return "tool_calls" if finish_reason == "stop" and parser.num_tool_calls else finish_reason


async def _stream(body: ChatCompletionRequest, run: ChatRun, state: ServerState) -> AsyncIterator[str]:
    created = int(time.time())
    request_id, n = run.request_id, body.n

    def chunk(choices: list[ChatStreamChoice], **fields) -> str:
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=run.model_name,
                                             choices=choices, system_fingerprint=state.system_fingerprint,
                                             **fields))

    choices = [ChoiceState() for _ in range(n)]
    parsers = [run.new_parser() for _ in range(n)]
    num_top = body.top_logprobs or 0
    as_token_ids = bool(body.return_tokens_as_token_ids)
    try:
        # As OpenAI: each choice opens with the role, before any text.
        for index in range(n):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        prompt_logprobs = None   # when asked: from the first output, sent with the first chunk after it
        async for _, output in run.merged:
            if output.prompt_logprobs is not None:
                prompt_logprobs = prompt_logprobs_field(output.prompt_logprobs)
            note_prompt_facts(choices, output)
            for delta in output.outputs:
                choice, parser = choices[delta.index], parsers[delta.index]
                if not has_news(choice, delta):
                    continue
                choice.add(delta)
                parts = parser.feed(delta.text)
                if delta.finish_reason is not None:
                    parts.extend(parser.finish())
                logprobs = (chat_logprobs(delta.token_ids, delta.logprobs or [], num_top, as_token_ids)
                            if body.logprobs else None)
                if not (parts or delta.finish_reason or logprobs):
                    continue   # text held back by a parser (a marker may be starting)
                message = DeltaMessage(content=parts.content if parts.content or not (parts.reasoning or parts.tool_calls)
                                       else None,
                                       reasoning_content=(parts.reasoning or None) if body.include_reasoning else None,
                                       tool_calls=parts.tool_calls or None)
                yield chunk([ChatStreamChoice(index=delta.index, delta=message, logprobs=logprobs,
                                              finish_reason=_finish_reason(delta.finish_reason, parser),
                                              stop_reason=delta.stop_reason)], prompt_logprobs=prompt_logprobs)
                prompt_logprobs = None
        if body.include_usage:
            yield chunk([], usage=usage([len(run.prompt_ids)], [choices]))
    except Exception as exc:
        yield sse_error(exc, request_id)
    yield SSE_DONE
