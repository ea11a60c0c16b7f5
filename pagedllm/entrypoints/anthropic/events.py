"""An answer's segments as an Anthropic message: its content blocks, and the stream events that build them
(message_start, ping, then per block content_block_start / _delta / _stop, and message_delta with the
stop reason and usage, message_stop). The whole message is built by the same code, without the events."""
from __future__ import annotations

import json

from pagedllm.entrypoints.anthropic.protocol import AnthropicUsage, MessageResponse, TextOut, ThinkingOut, ToolUseOut
from pagedllm.entrypoints.openai.answer_segments import AnswerSegments, AnswerStep, Segment, SegmentEvent
from pagedllm.entrypoints.openai.chat_output import ParsedDelta
from pagedllm.entrypoints.openai.serving_engine import ChoiceState

_DELTA_TYPES = {"text": ("text_delta", "text"), "tool_call": ("input_json_delta", "partial_json"),
                "reasoning": ("thinking_delta", "thinking")}


def usage(num_prompt_tokens: int, choice: ChoiceState) -> AnthropicUsage:
    """Anthropic's split of the prompt: read from the cache, written to it at the breakpoints (pinned tokens
    that were not read), and the rest."""
    created = max(0, choice.num_pinned_tokens - choice.num_cached_tokens)
    return AnthropicUsage(input_tokens=num_prompt_tokens - choice.num_cached_tokens - created,
                          cache_creation_input_tokens=created, cache_read_input_tokens=choice.num_cached_tokens,
                          output_tokens=len(choice.token_ids))


def stop_reason(choice: ChoiceState, called_tools: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): tool_use when the answer called tools, stop_sequence when one of
    stop_sequences ended it, max_tokens when cut short, else end_turn."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


class MessageBuilder:
    def __init__(self, message: MessageResponse):
        """message: the answer's shell (id, model, usage of the prompt), without content."""
        self.message = message
        self._segments = AnswerSegments()
        self._started = False

    def start(self, choice: ChoiceState, num_prompt_tokens: int) -> list[dict]:
        """Sent once the engine has admitted the request, so that the usage counts the cached tokens."""
        self.message.usage = usage(num_prompt_tokens, choice)
        return [{"type": "message_start", "message": self.message.model_dump(mode="json")}, {"type": "ping"}]

    def take(self, step: AnswerStep, num_prompt_tokens: int) -> list[dict]:
        """The events of one step of the answer (the whole answer is one step); the first opens the message."""
        events = [] if self._started else self.start(step.choice, num_prompt_tokens)
        self._started = True
        events += self.feed(step.parts)
        return events + self.finish(step.choice, num_prompt_tokens) if step.finished else events

    def feed(self, parts: ParsedDelta) -> list[dict]:
        return self._translate(self._segments.feed(parts))

    def finish(self, choice: ChoiceState, num_prompt_tokens: int) -> list[dict]:
        events = self._translate(self._segments.close())
        self.message.stop_reason, self.message.stop_sequence = stop_reason(choice, self._segments.has_tool_calls)
        self.message.usage = usage(num_prompt_tokens, choice)
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": self.message.stop_reason,
                                    "stop_sequence": self.message.stop_sequence},
                          "usage": self.message.usage.model_dump(mode="json")},
                         {"type": "message_stop"}]

    def _translate(self, segment_events: list[SegmentEvent]) -> list[dict]:
        events = []
        for event in segment_events:
            segment = event.segment
            if event.action == "start":
                block = _empty_block(segment)
                self.message.content.append(block)
                events.append({"type": "content_block_start", "index": segment.index,
                               "content_block": block.model_dump(mode="json")})
            elif event.action == "delta":
                delta_type, key = _DELTA_TYPES[segment.kind]
                events.append({"type": "content_block_delta", "index": segment.index,
                               "delta": {"type": delta_type, key: event.delta}})
            else:
                self.message.content[segment.index] = _whole_block(segment)
                events.append({"type": "content_block_stop", "index": segment.index})
        return events


def _empty_block(segment: Segment) -> TextOut | ToolUseOut | ThinkingOut:
    if segment.kind == "tool_call":
        return ToolUseOut(id=segment.call_id, name=segment.name, input={})
    return TextOut(text="") if segment.kind == "text" else ThinkingOut(thinking="")


def _whole_block(segment: Segment) -> TextOut | ToolUseOut | ThinkingOut:
    if segment.kind == "text":
        return TextOut(text=segment.text)
    if segment.kind == "reasoning":
        return ThinkingOut(thinking=segment.text)
    try:
        arguments = json.loads(segment.text)
    except ValueError:   # cut off by max_tokens mid-arguments: no input could be read
        arguments = {}
    return ToolUseOut(id=segment.call_id, name=segment.name, input=arguments if isinstance(arguments, dict) else {})
