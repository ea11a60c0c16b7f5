"""Hermes' form (Qwen2.5 / Qwen3, NousResearch Hermes, SmolLM-style templates): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text around the calls is content."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import Event, ToolParser, call_from_json, held_back_tail

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def __init__(self):
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            marker = END if self._in_call else START
            found = self._buffer.find(marker)
            if found < 0:
                break
            before, self._buffer = self._buffer[:found], self._buffer[found + len(marker):]
            if self._in_call:
                events.append(self._call_or_text(before))
            elif before:
                events.append(before)
            self._in_call = not self._in_call
        if not self._in_call:   # content streams on, bar what may be the start of a call marker
            keep = held_back_tail(self._buffer, START)
            if len(self._buffer) > keep:
                events.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
        return events

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if self._in_call:   # cut off inside a call (max_tokens): a call only if what came is whole
            self._in_call = False
            return [self._call_or_text(rest, unclosed=True)]
        return [rest] if rest else []

    @staticmethod
    def _call_or_text(body: str, unclosed: bool = False) -> Event:
        try:
            call = call_from_json(json.loads(body))
        except ValueError:
            call = None
        if call is not None:
            return call
        return START + body + ("" if unclosed else END)
