"""The request side of tool calling: tools, tool_choice, and the grammar that enforces `required` and
named choices (vLLM's shapes), so the arguments always parse against the function's schema."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.structured_requests import StrictModel

# A tool without parameters takes an empty object.
_NO_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # the grammar enforces the schema for required and named choices anyway


class ChatCompletionTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallParam(StrictModel):
    name: str
    arguments: str


class ToolCallParam(StrictModel):
    """A call in an assistant message of the conversation."""
    id: str
    type: Literal["function"]
    function: FunctionCallParam

    def as_template_call(self) -> dict:
        """As templates read it (transformers' convention): the arguments as an object."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


def tool_choice_mode(tools: list[ChatCompletionTool] | None, tool_choice: ToolChoice | None,
                     auto_enabled: bool) -> str | NamedToolChoice:
    """"none", "auto", "required" or the named choice; OpenAI's default is "auto" when tools are given."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice != "none" and not tools:
        raise APIError(400, f"tool_choice {_shown(tool_choice)} needs tools", param="tool_choice")
    if tool_choice == "auto" and not auto_enabled:
        raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                            '--tool-call-parser; use tool_choice "required", a named function or "none"',
                       param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        names = [tool.function.name for tool in tools]
        if tool_choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {tool_choice.function.name!r}, which is not among "
                                f"the tools ({', '.join(names)})", param="tool_choice")
    return tool_choice


def _shown(tool_choice) -> str:
    return tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else repr(tool_choice)


def forced_tool_schema(tools: list[ChatCompletionTool], mode: str | NamedToolChoice,
                       parallel_tool_calls: bool) -> dict | None:
    """The JSON schema the output must follow: a named choice writes that function's arguments; `required`
    writes a list of {"name", "parameters"} calls (one call when parallel_tool_calls is false)."""
    if isinstance(mode, NamedToolChoice):
        tool = next(tool for tool in tools if tool.function.name == mode.function.name)
        return tool.function.parameters or _NO_PARAMETERS
    if mode != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                             "parameters": tool.function.parameters or _NO_PARAMETERS},
              "required": ["name", "parameters"]}
             for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema
