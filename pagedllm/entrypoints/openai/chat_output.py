"""One chat choice's text as OpenAI's message parts: reasoning apart (--reasoning-parser), then tool
calls apart from content, by the request's tool choice. Streamed text is fed piece by piece; a whole
answer is fed in one piece, so both give the same message."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.response_protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from pagedllm.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser
from pagedllm.entrypoints.openai.tool_requests import NamedToolChoice


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedDelta:
    reasoning: str = ""
    # Content text and tool-call deltas in the order the answer gave them (the Responses and Messages
    # APIs keep that order in their output items and content blocks).
    pieces: list[str | DeltaToolCall] = field(default_factory=list)

    @property
    def content(self) -> str:
        return "".join(piece for piece in self.pieces if isinstance(piece, str))

    @property
    def tool_calls(self) -> list[DeltaToolCall]:
        return [piece for piece in self.pieces if not isinstance(piece, str)]

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.pieces)

    def add_content(self, text: str) -> None:
        if text:
            self.pieces.append(text)

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.pieces += other.pieces


class ChoiceParser:
    def __init__(self, reasoning_parser=None, tool_mode: str | NamedToolChoice = "none",
                 tool_parser: ToolParser | None = None, parallel_tool_calls: bool = True):
        """tool_mode "auto" needs tool_parser; "required" and named choices read the grammar's JSON. Without
        parallel_tool_calls an "auto" answer keeps its first call only (as OpenAI promises at most one)."""
        self._reasoning = reasoning_parser
        self._parallel = parallel_tool_calls
        self.reasoned = False   # the answer opened a reasoning block
        self._mode = tool_mode
        self._tool_parser = tool_parser
        self._required_text = ""   # "required": the JSON list of calls, parsed whole at the end
        self._named_id: str | None = None
        self.num_tool_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        delta = ParsedDelta()
        content = text
        if self._reasoning is not None:
            delta.reasoning, content = self._reasoning.feed(text)
            self.reasoned = self.reasoned or self._reasoning.is_reasoning
        self._route_content(content, delta)
        return delta

    def finish(self) -> ParsedDelta:
        delta = ParsedDelta()
        content = ""
        if self._reasoning is not None:
            delta.reasoning, content = self._reasoning.finish()
        self._route_content(content, delta)
        if self._mode == "auto":
            self._add_events(self._tool_parser.finish(), delta)
        elif self._mode == "required":
            calls = _required_calls(self._required_text)
            if calls is None:   # cut off by max_tokens: the text as it came
                delta.add_content(self._required_text)
            else:
                self._add_events(calls, delta)
        return delta

    def _route_content(self, content: str, delta: ParsedDelta) -> None:
        if not content:
            return
        if self._mode == "auto":
            self._add_events(self._tool_parser.feed(content), delta)
        elif self._mode == "required":
            self._required_text += content
        elif isinstance(self._mode, NamedToolChoice):   # the output is the arguments, streamed as they come
            if self._named_id is None:
                self._named_id = new_tool_call_id()
                self.num_tool_calls = 1
                delta.pieces.append(DeltaToolCall(index=0, id=self._named_id, type="function",
                                                  function=DeltaFunctionCall(name=self._mode.function.name,
                                                                             arguments=content)))
            else:
                delta.pieces.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=content)))
        else:
            delta.add_content(content)

    def _add_events(self, events: list, delta: ParsedDelta) -> None:
        for event in events:
            if isinstance(event, ParsedToolCall):
                if self.num_tool_calls and not self._parallel:
                    continue
                function = DeltaFunctionCall(name=event.name, arguments=event.arguments)
                delta.pieces.append(DeltaToolCall(index=self.num_tool_calls, id=new_tool_call_id(), type="function",
                                                  function=function))
                self.num_tool_calls += 1
            else:
                delta.add_content(event)


def _required_calls(text: str) -> list[ParsedToolCall] | None:
    """The grammar's [{"name", "parameters"}, ...]; None when the text is not that (cut by max_tokens or a stop)."""
    try:
        return [ParsedToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
                for call in json.loads(text)]
    except (ValueError, TypeError, KeyError):
        return None


def whole_tool_calls(deltas: list[DeltaToolCall]) -> list[ToolCall]:
    """Deltas assembled into calls, as a client assembles a stream: by index, arguments concatenated."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            calls[delta.index] = ToolCall(id=delta.id, function=FunctionCall(name=delta.function.name,
                                                                             arguments=delta.function.arguments or ""))
        else:
            call.function.arguments += delta.function.arguments or ""
    return [calls[index] for index in sorted(calls)]
