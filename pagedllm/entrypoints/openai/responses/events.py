"""An answer's segments as a Response: its output items, and the typed stream events that build them
in OpenAI's order (created, in_progress, then per item added / part added / deltas / done, and at
the end completed or incomplete). The whole response is built by the same code, without the events."""
from __future__ import annotations

import uuid
from collections.abc import Callable

from pagedllm.entrypoints.openai.answer_segments import AnswerSegments, AnswerStep, Segment, SegmentEvent
from pagedllm.entrypoints.openai.chat_output import ParsedDelta
from pagedllm.entrypoints.openai.responses.protocol import (IncompleteDetails, InputTokensDetails, OutputFunctionCall,
                                                            OutputItem, OutputMessage, OutputReasoning, OutputText,
                                                            OutputTokensDetails, ReasoningText, ResponseError,
                                                            ResponseObject, ResponseUsage)
from pagedllm.entrypoints.openai.serving_engine import ChoiceState

_ID_PREFIXES = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    def __init__(self, response: ResponseObject, count_tokens: Callable[[str], int]):
        """response: the request's echo, in progress, without output; count_tokens: tokens of a text
        (for the reasoning's share of the output tokens)."""
        self.response = response
        self._count_tokens = count_tokens
        self._segments = AnswerSegments()
        self._items: dict[int, OutputItem] = {}   # by segment index
        self._sequence_number = 0

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def take(self, step: AnswerStep, num_prompt_tokens: int) -> list[dict]:
        """The events of one step of the answer (the whole answer is one step)."""
        events = self.feed(step.parts)
        return events + self.finish(step.choice, num_prompt_tokens) if step.finished else events

    def feed(self, parts: ParsedDelta) -> list[dict]:
        return self._translate(self._segments.feed(parts))

    def finish(self, choice: ChoiceState, num_prompt_tokens: int) -> list[dict]:
        """Closes the open item and completes the response: "incomplete" when max_output_tokens (or the
        context) cut the answer short."""
        cut_short = choice.finish_reason == "length"
        events = self._translate(self._segments.close(), closing_status="incomplete" if cut_short else "completed")
        reasoning = "".join(s.text for s in self._segments.segments if s.kind == "reasoning")
        self.response.usage = ResponseUsage(
            input_tokens=num_prompt_tokens, output_tokens=len(choice.token_ids),
            total_tokens=num_prompt_tokens + len(choice.token_ids),
            input_tokens_details=InputTokensDetails(cached_tokens=choice.num_cached_tokens),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self._count_tokens(reasoning)
                                                      if reasoning else 0))
        if cut_short:
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            return events + [self._event("response.incomplete", response=self._snapshot())]
        self.response.status = "completed"
        return events + [self._event("response.completed", response=self._snapshot())]

    def fail(self, code: str, message: str) -> list[dict]:
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        return [self._event("response.failed", response=self._snapshot())]

    def _snapshot(self) -> dict:
        return self.response.model_dump(mode="json")

    def _event(self, event_type: str, **fields) -> dict:
        event = {"type": event_type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

    def _translate(self, segment_events: list[SegmentEvent], closing_status: str = "completed") -> list[dict]:
        events: list[dict] = []
        for segment_event in segment_events:
            segment = segment_event.segment
            if segment_event.action == "start":
                events += self._added(segment)
            elif segment_event.action == "delta":
                events.append(self._delta(segment, segment_event.delta))
            else:   # closed by the next segment: completed; by the end of the answer: as the answer ended
                events += self._done(segment, closing_status)
        return events

    def _added(self, segment: Segment) -> list[dict]:
        item_id = new_id(_ID_PREFIXES[segment.kind])
        if segment.kind == "tool_call":
            item = OutputFunctionCall(id=item_id, call_id=segment.call_id, name=segment.name, arguments="",
                                      status="in_progress")
        elif segment.kind == "text":
            item = OutputMessage(id=item_id, status="in_progress", content=[])
        else:
            item = OutputReasoning(id=item_id, status="in_progress", content=[])
        self._items[segment.index] = item
        self.response.output.append(item)
        events = [self._event("response.output_item.added", output_index=segment.index,
                              item=item.model_dump(mode="json"))]
        if segment.kind != "tool_call":
            part = OutputText(text="") if segment.kind == "text" else ReasoningText(text="")
            item.content.append(part)
            events.append(self._event("response.content_part.added", item_id=item_id, output_index=segment.index,
                                      content_index=0, part=part.model_dump(mode="json")))
        return events

    def _delta(self, segment: Segment, delta: str) -> dict:
        item = self._items[segment.index]
        where = {"item_id": item.id, "output_index": segment.index}
        if segment.kind == "tool_call":
            item.arguments += delta
            return self._event("response.function_call_arguments.delta", **where, delta=delta)
        item.content[0].text += delta
        if segment.kind == "text":
            return self._event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[])
        return self._event("response.reasoning_text.delta", **where, content_index=0, delta=delta)

    def _done(self, segment: Segment, status: str) -> list[dict]:
        item = self._items[segment.index]
        where = {"item_id": item.id, "output_index": segment.index}
        events = []
        if segment.kind == "tool_call":
            events.append(self._event("response.function_call_arguments.done", **where, name=item.name,
                                      arguments=item.arguments))
        else:
            part = item.content[0]
            if segment.kind == "text":
                events.append(self._event("response.output_text.done", **where, content_index=0, text=part.text,
                                          logprobs=[]))
            else:
                events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=part.text))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=part.model_dump(mode="json")))
        item.status = status
        events.append(self._event("response.output_item.done", output_index=segment.index,
                                  item=item.model_dump(mode="json")))
        return events
