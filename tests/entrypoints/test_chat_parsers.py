"""Tool-call and reasoning parsers without a model: hand-written answers, and the same answers fed in
random pieces (as a stream arrives) giving exactly what the whole answer gives."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.chat_output import ChoiceParser, whole_tool_calls
from pagedllm.entrypoints.openai.reasoning import Qwen3ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser, ParsedToolCall
from pagedllm.entrypoints.openai.tool_requests import NamedFunction, NamedToolChoice

CALL = ParsedToolCall("get_weather", json.dumps({"city": "Paris", "days": [1, 2]}))
HERMES = ('I will look it up. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}; ' \
        '{"name": "get_time", "parameters": {}}'
THINK = "<think>\nThe user wants a city.\n</think>\n\nParis is the capital."


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[start:end] for start, end in zip(points, points[1:])]


def test_hermes_reads_calls_and_keeps_the_text_around_them():
    content, calls = HermesToolParser().parse(HERMES)
    assert content == "I will look it up. \n"
    assert calls == [CALL, ParsedToolCall("get_time", "{}")]


def test_hermes_leaves_broken_or_cut_calls_as_text():
    broken = "<tool_call>{not json}</tool_call> after"
    assert HermesToolParser().parse(broken) == (broken, [])
    cut = 'Sure <tool_call>{"name": "get_weather", "argu'
    assert HermesToolParser().parse(cut) == (cut, [])
    whole_but_unclosed = '<tool_call>{"name": "get_time", "arguments": {}}'
    assert HermesToolParser().parse(whole_but_unclosed) == ("", [ParsedToolCall("get_time", "{}")])
    assert HermesToolParser().parse("no calls <tool at all") == ("no calls <tool at all", [])


def test_llama3_json_reads_calls_only_when_the_answer_is_calls():
    assert Llama3JsonToolParser().parse(LLAMA) == ("", [CALL, ParsedToolCall("get_time", "{}")])
    assert Llama3JsonToolParser().parse('  {"name": "get_time", "parameters": {}}') == (
        "", [ParsedToolCall("get_time", "{}")])
    text = 'The answer is {"name": "x"}'
    assert Llama3JsonToolParser().parse(text) == (text, [])
    assert Llama3JsonToolParser().parse('{"city": "Paris"}') == ('{"city": "Paris"}', [])


def test_qwen3_splits_reasoning_from_content():
    assert Qwen3ReasoningParser().parse(THINK) == ("\nThe user wants a city.\n", "Paris is the capital.")
    assert Qwen3ReasoningParser().parse("Just an answer.") == (None, "Just an answer.")
    assert Qwen3ReasoningParser().parse("<think>cut off mid-tho") == ("cut off mid-tho", "")
    assert Qwen3ReasoningParser().parse("<thin") == (None, "<thin")


def _fed(parser, pieces: list[str]):
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    content = "".join(event for event in events if isinstance(event, str))
    return content, [event for event in events if isinstance(event, ParsedToolCall)]


@given(st.sampled_from([HERMES, "plain <tool_ text", 'x<tool_call>{"name": "a", "arguments": {}}']),
       st.lists(st.integers(0, 400), max_size=12))
def test_hermes_streamed_in_any_pieces_equals_whole(text, cuts):
    assert _fed(HermesToolParser(), _pieces(text, cuts)) == HermesToolParser().parse(text)


@given(st.sampled_from([LLAMA, "Hello there", " <|python", '{"name": "a", "parameters": {}}']),
       st.lists(st.integers(0, 400), max_size=12))
def test_llama3_json_streamed_in_any_pieces_equals_whole(text, cuts):
    assert _fed(Llama3JsonToolParser(), _pieces(text, cuts)) == Llama3JsonToolParser().parse(text)


@given(st.sampled_from([THINK, "no thinking", "<think>never closed", "  <think>a</think>b", "<th"]),
       st.lists(st.integers(0, 200), max_size=10))
def test_qwen3_streamed_in_any_pieces_equals_whole(text, cuts):
    parser = Qwen3ReasoningParser()
    reasoning = content = ""
    for piece in _pieces(text, cuts):
        more_reasoning, more_content = parser.feed(piece)
        reasoning, content = reasoning + more_reasoning, content + more_content
    more_reasoning, more_content = parser.finish()
    whole_reasoning, whole_content = Qwen3ReasoningParser().parse(text)
    assert (reasoning + more_reasoning, content + more_content) == (whole_reasoning or "", whole_content)


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
@given(cuts=st.lists(st.integers(0, 400), max_size=12))
def test_choice_parser_deltas_assemble_into_the_whole_message(mode, cuts):
    text = {"auto": THINK.replace("Paris is the capital.", HERMES),
            "required": THINK.replace("Paris is the capital.",
                                      '[{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}]'),
            "named": THINK.replace("Paris is the capital.", '{"city": "Paris", "days": [1, 2]}')}[mode]
    tool_mode = NamedToolChoice(type="function", function=NamedFunction(name="get_weather")) if mode == "named" \
        else mode

    def parser():
        return ChoiceParser(Qwen3ReasoningParser(), tool_mode, HermesToolParser() if mode == "auto" else None)

    whole = parser()
    expected = whole.feed(text)
    expected.extend(whole.finish())
    streamed = parser()
    pieces = [streamed.feed(piece) for piece in _pieces(text, cuts)] + [streamed.finish()]
    assert "".join(p.reasoning for p in pieces) == expected.reasoning == "\nThe user wants a city.\n"
    assert "".join(p.content for p in pieces) == expected.content
    strip_ids = [(c.function.name, c.function.arguments) for c in whole_tool_calls(expected.tool_calls)]
    assert [(c.function.name, c.function.arguments)
            for c in whole_tool_calls([d for p in pieces for d in p.tool_calls])] == strip_ids
    assert strip_ids[0] == ("get_weather", CALL.arguments)
    assert streamed.num_tool_calls == whole.num_tool_calls == (2 if mode == "auto" else 1)


def test_without_parallel_tool_calls_auto_keeps_the_first_call():
    parser = ChoiceParser(None, "auto", HermesToolParser(), parallel_tool_calls=False)
    parts = parser.feed(HERMES)
    parts.extend(parser.finish())
    assert [c.function.name for c in whole_tool_calls(parts.tool_calls)] == ["get_weather"]
