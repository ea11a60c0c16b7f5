"""What every tool-call parser does: fed the model's text piece by piece, it hands back plain content
and whole tool calls as soon as each is complete. A whole answer is parsed by feeding it in one piece,
so streamed and whole answers give the same calls by construction."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str   # JSON text of the arguments object, as OpenAI sends it


Event = str | ParsedToolCall   # content text, or a complete call


class ToolParser:
    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """The end of the output: whatever was held back, as calls if it parses, else as content."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """A whole answer: its content (text outside the calls) and its calls."""
        events = self.feed(text) + self.finish()
        content = "".join(event for event in events if isinstance(event, str))
        return content, [event for event in events if isinstance(event, ParsedToolCall)]


def call_from_json(value) -> ParsedToolCall | None:
    """{"name": ..., "arguments" or "parameters": {...}} as a call, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):   # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def held_back_tail(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker (so must wait for more text)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
