"""Qwen3's `<think>...</think>`: an answer that opens with `<think>` reasons until `</think>` (or its
end, if cut off) and answers after it. Fed piece by piece, so streamed and whole answers split alike;
with `enable_thinking: false` Qwen3's template closes an empty think block in the prompt itself, and the
answer is all content."""
from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import held_back_tail

START, END = "<think>", "</think>"


class Qwen3ReasoningParser:
    def __init__(self):
        self._buffer = ""
        self._state = "start"   # start (undecided) -> reasoning -> after_think -> content, or start -> content
        self._reasoned = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that this piece of text settles."""
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            opening = self._buffer.lstrip()
            if START.startswith(opening):
                return "", ""   # may still become <think>
            if opening.startswith(START):
                self._state, self._buffer = "reasoning", opening[len(START):]
                self._reasoned = True
            else:
                self._state = "content"
        if self._state == "reasoning":
            found = self._buffer.find(END)
            if found < 0:
                keep = held_back_tail(self._buffer, END)
                reasoning = self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:found], self._buffer[found + len(END):].lstrip("\n")
            self._state = "content" if self._buffer else "after_think"
        if self._state == "after_think":   # the newlines Qwen3 writes after </think> are not content
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer:
                return reasoning, ""
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    @property
    def is_reasoning(self) -> bool:
        """The answer opened with <think> (whether or not it has closed it yet)."""
        return self._reasoned

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return rest, ""
        return "", rest if self._state in ("start", "content") else ""

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole answer: (reasoning, or None if it did not reason; content)."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return (reasoning + more_reasoning if self._reasoned else None), content + more_content
