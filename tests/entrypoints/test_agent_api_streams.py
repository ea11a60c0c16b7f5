"""The Responses and Messages APIs' answers without a model or a server: hand-written model text, fed to the
chat parsers whole and in random pieces (as a stream arrives), built into a response or a message and
into stream events; the events, assembled by the official clients' own stream code, must give exactly
the whole answer. Also the store of responses: its bound, its tenants, its TTL (on a fake clock)."""
from __future__ import annotations

import json
from typing import Annotated, get_args, get_origin

from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from pagedllm.entrypoints.anthropic.events import MessageBuilder
from pagedllm.entrypoints.anthropic.protocol import MessageResponse
from pagedllm.entrypoints.openai.answer_segments import AnswerStep
from pagedllm.entrypoints.openai.chat_output import ChoiceParser
from pagedllm.entrypoints.openai.reasoning import Qwen3ReasoningParser
from pagedllm.entrypoints.openai.responses.events import ResponseBuilder
from pagedllm.entrypoints.openai.responses.protocol import ResponseObject
from pagedllm.entrypoints.openai.responses.store import ResponseStore
from pagedllm.entrypoints.openai.serving_engine import ChoiceState
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser
from pagedllm.entrypoints.openai.tool_requests import NamedFunction, NamedToolChoice

THINK = "<think>\nThe user wants the weather.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TEXTS = {  # model text -> the tool mode it is read under
    "Paris is sunny today.": "none",
    THINK + "It is sunny.": "none",
    "Let me check. " + CALL + "\n" + CALL.replace("Paris", "Rome"): "auto",
    THINK + CALL + " Done.": "auto",
    '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}]': "required",
    '{"city": "Lima", "unit": "fahrenheit"}': "named",
}
NUM_PROMPT_TOKENS, NUM_CACHED_TOKENS = 40, 16


def _event_classes(union) -> dict:
    """{event type: the official client's class for it} of a union of event classes."""
    members = get_args(get_args(union)[0] if get_origin(union) is Annotated else union)
    return {get_args(cls.model_fields["type"].annotation)[0]: cls for cls in members}


RESPONSE_EVENTS = _event_classes(ResponseStreamEvent)
MESSAGE_EVENTS = _event_classes(RawMessageStreamEvent)


def _parser(mode: str) -> ChoiceParser:
    tool_mode = NamedToolChoice(type="function", function=NamedFunction(name="get_weather")) if mode == "named" \
        else mode
    return ChoiceParser(Qwen3ReasoningParser(), tool_mode, HermesToolParser() if mode == "auto" else None)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[start:end] for start, end in zip(points, points[1:])]


def _whole_events(builder, text: str, mode: str, choice: ChoiceState) -> list[dict]:
    """The answer fed whole, as the server builds a non-streamed answer: one step."""
    parser = _parser(mode)
    parts = parser.feed(text)
    parts.extend(parser.finish())
    return builder.take(AnswerStep(parts, choice, finished=True), NUM_PROMPT_TOKENS)


def _streamed_events(builder, text: str, mode: str, choice: ChoiceState, cuts: list[int]) -> list[dict]:
    """The answer fed in pieces, as the server streams it: a step per piece, the last one finishing."""
    parser, pieces = _parser(mode), _pieces(text, cuts)
    events = []
    for number, piece in enumerate(pieces, start=1):
        parts = parser.feed(piece)
        if number == len(pieces):
            parts.extend(parser.finish())
        events += builder.take(AnswerStep(parts, choice, finished=number == len(pieces)), NUM_PROMPT_TOKENS)
    return events


def _choice(finish_reason: str, stop_reason: str | None = None) -> ChoiceState:
    return ChoiceState(token_ids=list(range(7)), finish_reason=finish_reason, stop_reason=stop_reason,
                       num_cached_tokens=NUM_CACHED_TOKENS)


# ---------------------------------------------------------------- Responses

def _response_builder() -> ResponseBuilder:
    return ResponseBuilder(ResponseObject(id="resp_1", status="in_progress", model="m", created_at=1.0),
                           count_tokens=lambda text: len(text.split()))


def _whole_response(text: str, mode: str, choice: ChoiceState) -> dict:
    builder = _response_builder()
    _whole_events(builder, text, mode, choice)
    return builder.response.model_dump(mode="json")


def _streamed_response(text: str, mode: str, choice: ChoiceState, cuts: list[int]) -> tuple[list[str], dict]:
    """The events of the text streamed in pieces, checked against openai's event types and assembled by
    openai's own stream state (what client.responses.stream() uses): the final response it gives."""
    builder = _response_builder()
    events = builder.start() + _streamed_events(builder, text, mode, choice, cuts)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        handled = state.handle_event(RESPONSE_EVENTS[event["type"]].model_validate(event))
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return [event["type"] for event in events], handled[-1].response.model_dump(mode="json", exclude_none=True)


@settings(deadline=None)   # no test here depends on the machine's speed
@given(st.sampled_from(sorted(TEXTS)), st.lists(st.integers(0, 300), max_size=12),
       st.sampled_from(["stop", "length"]))
def test_streamed_response_events_assemble_into_the_whole_response(text, cuts, finish_reason):
    choice = _choice(finish_reason)
    whole = _whole_response(text, TEXTS[text], choice)
    types, streamed = _streamed_response(text, TEXTS[text], choice, cuts)

    def without_ids(response: dict) -> dict:
        return {**response, "output": [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                                       for item in response["output"]]}

    assert without_ids(streamed) == without_ids(Response.model_validate(whole).model_dump(mode="json",
                                                                                          exclude_none=True))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.incomplete" if finish_reason == "length" else "response.completed")
    assert whole["usage"]["input_tokens_details"]["cached_tokens"] == NUM_CACHED_TOKENS
    if finish_reason == "length":
        assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
        assert whole["output"][-1]["status"] == "incomplete"


def test_response_items_keep_the_answers_order():
    response = _whole_response(THINK + CALL + " Done.", "auto", _choice("stop"))
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call", "message"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "\nThe user wants the weather.\n"}]
    assert json.loads(response["output"][1]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert response["output"][2]["content"][0]["text"] == " Done."
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 5   # the fake count: words
    Response.model_validate(response)   # the official type takes it


# ---------------------------------------------------------------- Messages

def _message_builder() -> MessageBuilder:
    return MessageBuilder(MessageResponse(id="msg_1", model="m", usage={"input_tokens": 0, "output_tokens": 0}))


def _whole_message(text: str, mode: str, choice: ChoiceState) -> dict:
    builder = _message_builder()
    _whole_events(builder, text, mode, choice)
    return builder.message.model_dump(mode="json")


def _streamed_message(text: str, mode: str, choice: ChoiceState, cuts: list[int]) -> tuple[list[str], Message]:
    """The events of the text streamed in pieces, checked against anthropic's event types and assembled by
    anthropic's own accumulate_event (what client.messages.stream() uses)."""
    events = _streamed_events(_message_builder(), text, mode, choice, cuts)
    snapshot, json_buffers = None, {}
    for event in events:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=MESSAGE_EVENTS[event["type"]].model_validate(event),
                                        current_snapshot=snapshot, json_bufs=json_buffers)
    return [event["type"] for event in events], snapshot


@settings(deadline=None)
@given(st.sampled_from(sorted(TEXTS)), st.lists(st.integers(0, 300), max_size=12),
       st.sampled_from([("stop", None), ("length", None), ("stop", "today")]))
def test_streamed_message_events_assemble_into_the_whole_message(text, cuts, finish):
    choice = _choice(*finish)
    whole = _whole_message(text, TEXTS[text], choice)
    types, assembled = _streamed_message(text, TEXTS[text], choice, cuts)
    def without_ids(message: dict) -> dict:
        return {**message, "content": [{k: v for k, v in block.items() if k != "id"} for block in message["content"]]}

    assert without_ids(assembled.model_dump(mode="json", exclude_none=True)) == \
        without_ids(Message.model_validate(whole).model_dump(mode="json", exclude_none=True))
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    assert whole["usage"] == {"input_tokens": NUM_PROMPT_TOKENS - NUM_CACHED_TOKENS, "output_tokens": 7,
                              "cache_read_input_tokens": NUM_CACHED_TOKENS, "cache_creation_input_tokens": 0}
    expected = {"length": "max_tokens"}.get(finish[0]) or (
        "tool_use" if TEXTS[text] != "none" else "stop_sequence" if finish[1] else "end_turn")
    assert whole["stop_reason"] == expected
    assert whole["stop_sequence"] == (finish[1] if expected == "stop_sequence" else None)


def test_message_blocks_keep_the_answers_order():
    message = _whole_message(THINK + CALL + " Done.", "auto", _choice("stop"))
    assert [block["type"] for block in message["content"]] == ["thinking", "tool_use", "text"]
    assert message["content"][1]["input"] == {"city": "Paris", "unit": "celsius"}
    Message.model_validate(message)


# ---------------------------------------------------------------- the store of responses

class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _stored(response_id: str) -> ResponseObject:
    return ResponseObject(id=response_id, status="completed", model="m")


def test_the_store_evicts_the_oldest_past_its_size():
    store = ResponseStore(max_entries=3, ttl_seconds=60, clock=FakeClock())
    for index in range(5):
        store.put(_stored(f"r{index}"), [], tenant=None)
    assert len(store) == 3
    assert [store.get(f"r{index}", None) is not None for index in range(5)] == [False, False, True, True, True]


def test_the_store_shows_each_tenant_its_own_only():
    store = ResponseStore(max_entries=3, ttl_seconds=60, clock=FakeClock())
    store.put(_stored("r"), [{"role": "user", "content": "x"}], tenant="alice")
    assert store.get("r", "alice").conversation == [{"role": "user", "content": "x"}]
    assert store.get("r", "bob") is None and store.get("r", None) is None
    assert not store.delete("r", "bob") and store.get("r", "alice") is not None
    assert store.delete("r", "alice") and store.get("r", "alice") is None


def test_the_store_forgets_entries_older_than_its_ttl():
    clock = FakeClock()
    store = ResponseStore(max_entries=3, ttl_seconds=10, clock=clock)
    store.put(_stored("old"), [], tenant=None)
    clock.now = 6
    store.put(_stored("new"), [], tenant=None)
    clock.now = 10
    assert store.get("old", None) is not None
    clock.now = 10.5
    assert store.get("old", None) is None and store.get("new", None) is not None
    assert len(store) == 1
