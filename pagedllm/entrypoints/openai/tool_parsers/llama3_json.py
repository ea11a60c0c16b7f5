"""Llama 3's JSON form: the whole answer is one or more `{"name": ..., "parameters": {...}}` objects,
optionally after `<|python_tag|>`, separated by `;`. An answer that does not start so is content."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import Event, ParsedToolCall, ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def __init__(self):
        self._buffer = ""
        self._decided: bool | None = None   # None: too little text yet to tell calls from content

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        if self._decided is None:
            start = self._buffer.lstrip()
            if not start:
                return []
            if start.startswith("{") or start.startswith(PYTHON_TAG):
                self._decided = True
            elif PYTHON_TAG.startswith(start):
                return []
            else:
                self._decided = False
        if self._decided:
            return []   # calls are held until the end, where they are parsed whole
        text, self._buffer = self._buffer, ""
        return [text]

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        if not self._decided:
            return [text] if text else []
        calls = _parse_calls(text)
        return calls if calls is not None else [text]


def _parse_calls(text: str) -> list[ParsedToolCall] | None:
    decoder = json.JSONDecoder()
    rest = text.strip().removeprefix(PYTHON_TAG).strip()
    calls = []
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        call = call_from_json(value)
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].strip()
        if rest.startswith(";"):
            rest = rest[1:].strip()
    return calls or None
