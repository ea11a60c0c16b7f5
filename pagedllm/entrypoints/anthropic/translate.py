"""A Messages request as the chat request it means: the system prompt as a system message, content blocks as
chat messages (tool_use as assistant tool calls, tool_result as tool messages), tools and tool_choice in
chat's shape. From there the chat path does everything: template, sampling, tool grammars, parsers.

cache_control breakpoints become CacheBreakpoints: the request cut after each marked block, in Anthropic's
prefix order (tools, then system, then messages), which the chat path renders to find the prompt prefix to pin."""
from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.anthropic.protocol import (CacheControl, CountTokensRequest, CustomTool, MessageParam,
                                                     MessagesRequest, OtherBlock, ServerTool, TextBlock,
                                                     ToolResultBlock, ToolUseBlock)
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.serving_chat import CacheBreakpoint
from pagedllm.entrypoints.openai.tool_requests import ChatCompletionTool
from pagedllm.entrypoints.openai.translated_requests import chat_request_from

MAX_CACHE_BREAKPOINTS = 4   # Anthropic's limit on blocks with cache_control in one request
TTL_SECONDS = {None: 300.0, "5m": 300.0, "1h": 3600.0}

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Chat's names for fields, as this API calls them (for the 400s the chat path raises).
MESSAGES_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                  "response_format": "output_config.format"}


def _refuse_unsupported(body: CountTokensRequest) -> None:
    for index, tool in enumerate(body.tools or []):
        if isinstance(tool, ServerTool):
            raise APIError(400, f"tools.{index}: the server tool {tool.type!r} is not supported; only custom tools "
                                "(name, description, input_schema) are", param=f"tools.{index}")
    for index, message in enumerate(body.messages):
        for block_index, block in enumerate(message.content if isinstance(message.content, list) else []):
            if isinstance(block, OtherBlock):
                where = f"messages.{index}.content.{block_index}"
                raise APIError(400, f"{where}: {block.type!r} blocks are not supported; this server takes text, "
                                    "tool_use and tool_result blocks", param=where)
    if body.thinking is not None and body.thinking.type == "enabled":
        raise APIError(400, "thinking cannot be budgeted: the model thinks as its chat template says, and "
                            "--reasoning-parser returns its thinking as thinking blocks; send {\"type\": \"disabled\"} "
                            "or leave it out", param="thinking")


def _system_text(system: str | list[TextBlock] | None) -> str | None:
    if isinstance(system, list):
        return "\n".join(block.text for block in system)
    return system


def _chat_messages(message: MessageParam) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages (in their
    place among its text), an assistant turn's tool_use blocks its tool calls; thinking is dropped."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    messages: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []

    def flush_text() -> None:
        if texts and message.role == "user":
            messages.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            flush_text()
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
    if message.role == "assistant":
        return [{"role": "assistant", "content": "\n".join(texts) if texts or not calls else None,
                 **({"tool_calls": calls} if calls else {})}]
    flush_text()
    return messages


def _response_format(body: CountTokensRequest) -> dict | None:
    """output_config.format as chat's response_format (json_schema: the grammar enforces the schema)."""
    config = body.output_config
    if config is None:
        return None
    if config.effort is not None:
        raise APIError(400, "output_config.effort cannot be set: the model answers as its chat template says",
                       param="output_config.effort")
    if config.format is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": config.format.json_schema}}


def _tool_choice(body: CountTokensRequest) -> str | dict | None:
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise APIError(400, 'tool_choice of type "tool" needs the name of the tool', param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return _TOOL_CHOICES[choice.type]


def _template_input(body: CountTokensRequest) -> tuple[list[dict], list[dict] | None]:
    """The chat messages and tools (chat's shapes) that the request shows the chat template."""
    system = _system_text(body.system)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        chat_message for message in body.messages for chat_message in _chat_messages(message)]
    tools = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                               "parameters": tool.input_schema}}
             for tool in body.tools or []]
    return messages, tools or None


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request means; a 400 for what cannot be honoured."""
    _refuse_unsupported(body)
    messages, tools = _template_input(body)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "tool_choice": _tool_choice(body),
                              "tools": tools, "response_format": _response_format(body)}
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        fields.update(max_completion_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k)
    return chat_request_from(fields)


def _marked_prefixes(body: CountTokensRequest) -> list[tuple[str, CacheControl, CountTokensRequest]]:
    """(field, its cache_control, the request cut after that block) for every marked block, in Anthropic's
    prefix order: tools, system, messages (a tool_result's own text blocks inside it); the top-level
    cache_control marks the last block."""
    marked = []
    for index, tool in enumerate(body.tools or []):
        if isinstance(tool, CustomTool) and tool.cache_control is not None:
            marked.append((f"tools.{index}.cache_control", tool.cache_control,
                           body.model_copy(update={"tools": body.tools[:index + 1], "system": None, "messages": []})))
    for index, block in enumerate(body.system if isinstance(body.system, list) else []):
        if block.cache_control is not None:
            marked.append((f"system.{index}.cache_control", block.cache_control,
                           body.model_copy(update={"system": body.system[:index + 1], "messages": []})))
    for index, message in enumerate(body.messages):
        for block_index, block in enumerate(message.content if isinstance(message.content, list) else []):
            where = f"messages.{index}.content.{block_index}"
            for cut, control in _marked_cuts(block, where):
                content = message.content[:block_index] + [cut]
                marked.append((control[0], control[1], body.model_copy(update={
                    "messages": body.messages[:index] + [message.model_copy(update={"content": content})]})))
    if body.cache_control is not None:
        marked.append(("cache_control", body.cache_control, body))
    return marked


def _marked_cuts(block: Any, where: str) -> list[tuple[Any, tuple[str, CacheControl]]]:
    """A content block's breakpoints: (the block cut after the marked part, (field, cache_control))."""
    cuts = []
    if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
        for index, part in enumerate(block.content):
            if part.cache_control is not None:
                cuts.append((block.model_copy(update={"content": block.content[:index + 1]}),
                             (f"{where}.content.{index}.cache_control", part.cache_control)))
    control = getattr(block, "cache_control", None)
    if control is not None:
        cuts.append((block, (f"{where}.cache_control", control)))
    return cuts


def cache_breakpoints(body: CountTokensRequest) -> list[CacheBreakpoint]:
    """The prefixes the request marks to keep cached; a 400 past Anthropic's 4 breakpoints, or for a 1h
    breakpoint after a 5m one (a longer-lived prefix must be the shorter one, as Anthropic requires)."""
    marked = _marked_prefixes(body)
    if len(marked) > MAX_CACHE_BREAKPOINTS:
        raise APIError(400, f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. Found "
                            f"{len(marked)} ({', '.join(where for where, _, _ in marked)})", param=marked[-1][0])
    breakpoints = []
    shortest_ttl = None
    for where, control, prefix in marked:
        ttl_s = TTL_SECONDS[control.ttl]
        if shortest_ttl is not None and ttl_s > shortest_ttl:
            raise APIError(400, f"{where}: a cache_control with ttl {control.ttl!r} may not come after one with a "
                                "shorter ttl (longer-lived breakpoints come first)", param=where)
        shortest_ttl = ttl_s
        messages, tools = _template_input(prefix)
        breakpoints.append(CacheBreakpoint([ChatMessage.model_validate(message) for message in messages],
                                           [ChatCompletionTool.model_validate(tool) for tool in tools or []],
                                           ttl_s, where))
    return breakpoints
