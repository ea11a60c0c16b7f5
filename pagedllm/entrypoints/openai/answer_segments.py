"""One chat answer (n = 1) as an ordered run of segments: reasoning, text, tool calls. The Responses API
makes each segment an output item and the Messages API a content block, streamed or whole.

Both are fed the parsed pieces the chat parsers give (chat_output.ChoiceParser): a streamed answer
piece by piece, a whole answer in one piece. Pieces keep the answer's order, so both ways open, grow
and close the same segments.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from fastapi import Request

from pagedllm.entrypoints.openai.chat_output import ChoiceParser, ParsedDelta
from pagedllm.entrypoints.openai.serving_engine import ChoiceState, note_prompt_facts
from pagedllm.entrypoints.openai.streams import unless_disconnected
from pagedllm.outputs import RequestOutput


@dataclass
class Segment:
    kind: Literal["reasoning", "text", "tool_call"]
    index: int                  # its place among the answer's segments
    text: str = ""              # the reasoning, the text, or the call's arguments (JSON text)
    call_id: str | None = None  # tool calls: the id the result will be sent back under
    name: str | None = None     # tool calls: the function


@dataclass
class SegmentEvent:
    action: Literal["start", "delta", "stop"]
    segment: Segment
    delta: str = ""


@dataclass
class AnswerSegments:
    segments: list[Segment] = field(default_factory=list)
    _open: Segment | None = None

    def feed(self, parts: ParsedDelta) -> list[SegmentEvent]:
        events: list[SegmentEvent] = []
        if parts.reasoning:
            self._grow("reasoning", parts.reasoning, events)
        for piece in parts.pieces:
            if isinstance(piece, str):
                self._grow("text", piece, events)
            elif piece.id is not None:   # a new call
                self._start("tool_call", events, call_id=piece.id, name=piece.function.name)
                self._grow("tool_call", piece.function.arguments or "", events)
            else:                        # more of the open call's arguments
                self._grow("tool_call", piece.function.arguments or "", events)
        return events

    def close(self) -> list[SegmentEvent]:
        events: list[SegmentEvent] = []
        self._stop(events)
        return events

    @property
    def has_tool_calls(self) -> bool:
        return any(segment.kind == "tool_call" for segment in self.segments)

    def _grow(self, kind: str, text: str, events: list[SegmentEvent]) -> None:
        if self._open is None or self._open.kind != kind:
            self._start(kind, events)
        if text:
            self._open.text += text
            events.append(SegmentEvent("delta", self._open, text))

    def _start(self, kind: str, events: list[SegmentEvent], **fields) -> None:
        self._stop(events)
        self._open = Segment(kind, len(self.segments), **fields)
        self.segments.append(self._open)
        events.append(SegmentEvent("start", self._open))

    def _stop(self, events: list[SegmentEvent]) -> None:
        if self._open is not None:
            events.append(SegmentEvent("stop", self._open))
            self._open = None


@dataclass
class AnswerStep:
    """What one engine output added to the answer: its parsed pieces, and the answer so far (tokens,
    finish reason, cached prompt tokens) in `choice`."""
    parts: ParsedDelta
    choice: ChoiceState
    finished: bool


class StepBuilder(Protocol):
    """A Responses or Messages builder: each step of an answer in, that API's events out."""
    def take(self, step: AnswerStep, num_prompt_tokens: int) -> list[dict]: ...


async def streamed_events(merged: AsyncIterator[tuple[int, RequestOutput]], parser: ChoiceParser,
                          builder: StepBuilder, num_prompt_tokens: int) -> AsyncIterator[dict]:
    async for step in answer_steps(merged, parser):
        for event in builder.take(step, num_prompt_tokens):
            yield event


async def answer_steps(merged: AsyncIterator[tuple[int, RequestOutput]],
                       parser: ChoiceParser) -> AsyncIterator[AnswerStep]:
    """A one-choice answer as it streams; the last step holds what the parser kept back to the end."""
    choice = ChoiceState()
    async for _, output in merged:
        note_prompt_facts([choice], output)
        for delta in output.outputs:
            choice.add(delta)
            parts = parser.feed(delta.text)
            if delta.finish_reason is not None:
                parts.extend(parser.finish())
            yield AnswerStep(parts, choice, delta.finish_reason is not None)


async def whole_answer(raw_request: Request, merged: AsyncIterator[tuple[int, RequestOutput]],
                       parser: ChoiceParser) -> AnswerStep | None:
    """A one-choice answer whole, its text parsed in one piece; None if the client left first."""
    async def collect() -> ChoiceState:
        choice = ChoiceState()
        async for _, output in merged:
            note_prompt_facts([choice], output)
            for delta in output.outputs:
                choice.add(delta)
        return choice

    choice = await unless_disconnected(raw_request, collect())
    if choice is None:
        return None
    parts = parser.feed(choice.text)
    parts.extend(parser.finish())
    return AnswerStep(parts, choice, True)
