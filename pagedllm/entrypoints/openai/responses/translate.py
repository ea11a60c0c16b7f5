"""A Responses request as the chat request it means: input items become chat messages (after the stored
conversation of previous_response_id), function tools chat tools, text.format a response_format. From
there the chat path does everything: template, sampling, tool grammars, parsers."""
from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.translated_requests import chat_request_from
from pagedllm.entrypoints.openai.responses.protocol import (BuiltInTool, FunctionCallItem, FunctionCallOutputItem,
                                                            InputMessage, NamedFunctionChoice, ResponsesRequest,
                                                            TextFormat)

# Chat's names for fields, as this API calls them (for the 400s the chat path raises).
RESPONSES_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                   "messages": "input", "response_format": "text.format"}
# vLLM's extras passed on under the same name.
_PASSED_ON = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "priority", "cache_salt",
              "chat_template_kwargs", "parallel_tool_calls")


def check_refused(body: ResponsesRequest) -> None:
    """Fields declared so they can be read, whose other values this server cannot honour: a 400 naming each."""
    if body.background:
        raise APIError(400, "background is not supported: responses are generated while the request waits "
                            "(stream them to see progress)", param="background")
    if body.truncation == "auto":
        raise APIError(400, 'truncation "auto" is not supported: prompts are never truncated; send "disabled"',
                       param="truncation")
    if body.include:
        raise APIError(400, f"include is not supported ({', '.join(body.include)}): responses carry no extra "
                            "data to include; send [] or leave it out", param="include")
    for name in ("effort", "summary", "generate_summary"):
        if body.reasoning is not None and getattr(body.reasoning, name) is not None:
            raise APIError(400, f"reasoning.{name} cannot be set: the model reasons as its chat template says "
                                "(chat_template_kwargs reach the template); --reasoning-parser returns the reasoning",
                           param=f"reasoning.{name}")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise APIError(400, "text.verbosity cannot be set: the model cannot be told how long to answer",
                       param="text.verbosity")
    for index, tool in enumerate(body.tools or []):
        if isinstance(tool, BuiltInTool):
            raise APIError(400, f"tools.{index}: the built-in tool {tool.type!r} is not supported; only function "
                                "tools are", param=f"tools.{index}")


def input_messages(items: str | list) -> list[dict]:
    """Input items as chat messages: function calls join the assistant message before them, their outputs
    become tool messages, reasoning passed back is dropped (templates do not read it)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def _response_format(text_format: TextFormat | None) -> dict | None:
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.name is None or text_format.json_schema is None:
        raise APIError(400, "text.format json_schema needs name and schema", param="text.format")
    return {"type": "json_schema", "json_schema": {"name": text_format.name, "schema": text_format.json_schema}}


def _tool_choice(choice: str | NamedFunctionChoice | None) -> str | dict | None:
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def chat_request(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat request: instructions as the system message, then the conversation (stored turns and
    this request's input)."""
    fields: dict[str, Any] = {name: getattr(body, name) for name in _PASSED_ON if getattr(body, name) is not None}
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    fields.update(model=body.model, messages=system + conversation, max_completion_tokens=body.max_output_tokens,
                  response_format=_response_format(body.text.format if body.text else None),
                  tool_choice=_tool_choice(body.tool_choice))
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    return chat_request_from(fields)
