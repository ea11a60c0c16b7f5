"""Tool-call parsers (`--tool-call-parser`, vLLM's names): model text -> content and tool calls."""
from pagedllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}

__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolParser"]
