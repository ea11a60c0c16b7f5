"""Structured outputs, tools and reasoning through `pagedllm serve` on loopback, with the official openai
client. Every structured output is checked by an independent reference: jsonschema for JSON, re for
regexes and grammars, pydantic for the parsed model."""
from __future__ import annotations

import asyncio
import json
import re
from importlib import resources

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from pagedllm.bench.server_process import ServerProcess

MODEL = "smollm2"
FLAGS = ("--kv-cache-memory", "1GiB", "--max-model-len", "1024", "--served-model-name", MODEL)
SERVER_FLAGS = (*FLAGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
ASK = [{"role": "user", "content": "Fill in the JSON object."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                 "pattern": "^[A-Z]{3}$"}},
                                       "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# The bundled model does not know Hermes' markers; with tool_choice "auto" a grammar makes it write one.
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", '
               r'"unit": "celsius"\}\}\n</tool_call>')
THINKING = r"<think>\n[a-z ]{5,40}\n</think>\n\n[A-Z][a-z ]{3,30}\."


def _error(http_response: httpx.Response) -> dict:
    assert http_response.status_code == 400, http_response.text
    return http_response.json()["error"]


def _chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body},
                      timeout=300)


# ---- structured outputs ----

class City(BaseModel):
    name: str = Field(max_length=30)
    population: int = Field(ge=0, le=50_000_000)
    country_code: str = Field(pattern="^[A-Z]{2}$")
    coastal: bool


def test_parse_returns_the_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Lisbon."}],
                                               response_format=City, max_tokens=100, temperature=0)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and completion.choices[0].finish_reason == "stop"
    assert re.fullmatch("[A-Z]{2}", city.country_code)


_NAMES = st.sampled_from(["id", "name", "size", "tags", "kind", "score", "items", "owner", "code", "ok"])
_LEAVES = st.one_of(
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-1000, 1000), st.integers(0, 1000)),
    st.builds(lambda low, span: {"type": "number", "minimum": low, "maximum": low + span},
              st.integers(-100, 100), st.integers(1, 100)),
    st.builds(lambda length: {"type": "string", "maxLength": length}, st.integers(1, 12)),
    st.sampled_from([{"type": "string", "pattern": p} for p in
                     ("^[a-z]{2,6}$", "^[A-Z][a-z]{1,8}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$")]),
    st.lists(st.text("abcdefgh xyz", min_size=1, max_size=6), min_size=1, max_size=4, unique=True)
      .map(lambda values: {"enum": values}),
    st.just({"type": "boolean"}),
)


def _object(properties: dict, required_flags: list[bool]) -> dict:
    names = list(properties)
    required = [name for name, flag in zip(names, required_flags) if flag]
    return {"type": "object", "properties": properties, "required": required}


def _objects(children):
    return st.dictionaries(_NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda flags: _object(props, flags)))


_VALUES = st.recursive(_LEAVES, lambda children: st.one_of(
    st.builds(lambda items, low, extra: {"type": "array", "items": items, "minItems": low, "maxItems": low + extra},
              children, st.integers(0, 1), st.integers(1, 2)),
    _objects(children)), max_leaves=6)
JSON_SCHEMAS = _objects(_VALUES)


@settings(max_examples=1, derandomize=True, deadline=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(JSON_SCHEMAS, min_size=50, max_size=50))
def test_fifty_generated_schemas_validate_greedy_and_sampled(server, schemas):
    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=600) as aclient:
            calls = [aclient.chat.completions.create(
                         model=MODEL, messages=ASK, max_tokens=600, temperature=temperature, seed=index,
                         response_format={"type": "json_schema",
                                          "json_schema": {"name": f"schema{index}", "schema": schema, "strict": True}})
                     for temperature in (0.0, 1.0) for index, schema in enumerate(schemas)]
            return await asyncio.gather(*calls)

    answers = asyncio.run(run_all())
    for answer, schema in zip(answers, schemas + schemas):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_choice_and_ebnf_grammars(server, client):
    regex = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                           extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", regex.choices[0].message.content)
    choice = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=5,
                                            extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert choice.choices[0].message.content in ("alpha", "beta", "gamma")
    grammar = 'root ::= "SELECT " column (", " column)? (", " column)? " FROM t"\ncolumn ::= "a" | "b" | "c"'
    ebnf = client.completions.create(model=MODEL, prompt="SQL:", max_tokens=40, temperature=0,
                                     extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"SELECT [abc](, [abc]){0,2} FROM t", ebnf.choices[0].text)
    legacy = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                            extra_body={"guided_json": {"type": "object", "properties": {
                                                "n": {"type": "integer", "minimum": 1, "maximum": 9}},
                                                "required": ["n"]}})
    assert 1 <= json.loads(legacy.choices[0].message.content)["n"] <= 9
    anything = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300, temperature=0,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_max_tokens_inside_the_structure_is_length(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                            extra_body={"structured_outputs": {"json": City.model_json_schema()}})
    assert answer.choices[0].finish_reason == "length"


def test_bad_specs_are_400_naming_the_field(server):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
    assert _error(_chat(server, response_format=bad_schema))["param"] == "response_format"
    error = _error(_chat(server, guided_regex="a(b"))
    assert error["param"] == "guided_regex" and "not a valid regular expression" in error["message"]
    error = _error(_chat(server, structured_outputs={"grammar": "root ::= nothing"}))
    assert error["param"] == "structured_outputs" and "nothing" in error["message"]
    error = _error(_chat(server, guided_regex="a", guided_choice=["b"]))
    assert error["param"] == "guided_choice" and "only one of" in error["message"]
    assert "regexp" in json.dumps(_error(_chat(server, structured_outputs={"regexp": "a"})))
    assert _error(_chat(server, response_format={"type": "json_schema"}))["param"] == "response_format"
    assert _error(httpx.post(f"{server.url}/v1/completions", json={
        "prompt": "x", "use_beam_search": True, "n": 2, "max_tokens": 4, "guided_regex": "a+"},
        timeout=60))["param"] == "guided_regex"
    # Nothing in flight is lost to the bad requests: the server still answers.
    assert _chat(server, max_tokens=2).status_code == 200


# ---- tools ----

def _assert_valid_calls(message) -> list:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


def test_required_tool_choice_gives_valid_calls(client):
    # Sampled, one call (parallel_tool_calls false): a list of calls without bound could run to max_tokens.
    for temperature, parallel in ((0.0, True), (1.0, False)):
        answer = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=parallel, max_tokens=200,
                                                temperature=temperature, seed=11)
        assert answer.choices[0].finish_reason == "tool_calls"
        assert answer.choices[0].message.content is None
        calls = _assert_valid_calls(answer.choices[0].message)
        assert parallel or len(calls) == 1


def test_named_tool_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice=named,
                                            max_tokens=100, temperature=0)
    [call] = _assert_valid_calls(answer.choices[0].message)
    assert call.function.name == "get_time"


def _streamed(client, **request) -> tuple[list, str, str | None]:
    """The stream's tool-call deltas assembled as a client does, its content, and its finish reason."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] = call["name"] or delta.function.name
                call["arguments"] += delta.function.arguments or ""
    return [calls[index] for index in sorted(calls)], content, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"])
def test_streamed_tool_call_deltas_assemble_into_the_same_calls(client, choice):
    request = dict(messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0)
    if choice == "auto":
        request["extra_body"] = {"guided_regex": r"Let me check\. " + HERMES_CALL}
    whole = client.chat.completions.create(**request, model=MODEL)
    calls, content, finish = _streamed(client, **request)
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in _assert_valid_calls(whole.choices[0].message)]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected
    assert all(c["id"].startswith("call_") for c in calls)
    assert finish == whole.choices[0].finish_reason
    assert content == (whole.choices[0].message.content or "")
    if choice == "auto":   # the hermes parser: text around the call is content
        assert content == "Let me check. " and finish == "tool_calls"


def test_a_full_tool_round_trip(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0)
    [call] = _assert_valid_calls(first.choices[0].message)
    conversation = ASK_WEATHER + [
        first.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    answer = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none",
                                            max_tokens=40, temperature=0)
    message = answer.choices[0].message
    assert message.content and not message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_tool_request_errors_are_400(server):
    assert _error(_chat(server, tool_choice="required"))["param"] == "tool_choice"
    named = {"type": "function", "function": {"name": "nope"}}
    assert "nope" in _error(_chat(server, tools=TOOLS, tool_choice=named))["message"]
    error = _error(_chat(server, tools=TOOLS, tool_choice="required", guided_regex="a"))
    assert error["param"] == "guided_regex"
    assert "tool_call_id" in _error(_chat(server, messages=ASK + [{"role": "tool", "content": "1"}]))["message"]
    assert "content is required" in _error(_chat(server, messages=[{"role": "user"}]))["message"]


# ---- reasoning ----

def test_reasoning_content_is_split_off_whole_and_streamed(client):
    request = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0, extra_body={"guided_regex": THINKING})
    whole = client.chat.completions.create(**request).choices[0].message
    assert re.fullmatch(r"\n[a-z ]{5,40}\n", whole.reasoning_content)   # between the tags
    assert re.fullmatch(r"[A-Z][a-z ]{3,30}\.", whole.content)
    reasoning = content = ""
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)
    hidden = client.chat.completions.create(**{**request, "extra_body": {"guided_regex": THINKING,
                                                                         "include_reasoning": False}})
    assert hidden.choices[0].message.content == whole.content
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content and plain.choices[0].message.reasoning_content is None


# ---- the chat template: tools and chat_template_kwargs reach it ----

THINKING_SWITCH = ("{%- if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                   "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def template_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("template-server")
    shipped = resources.files("pagedllm.entrypoints.openai") / "chat_templates" / "chatml_hermes_tools.jinja"
    template = folder / "template.jinja"
    template.write_text(shipped.read_text() + THINKING_SWITCH)
    process = ServerProcess(folder / "server.log", *FLAGS, "--chat-template", str(template))
    yield process
    process.stop()


def _prompt_text(server, **body) -> str:
    response = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return httpx.post(f"{server.url}/detokenize", json={"tokens": response.json()["tokens"]}, timeout=60).json()["prompt"]


def test_tools_and_template_kwargs_reach_the_template(template_server):
    conversation = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
        {"role": "developer", "content": "Be brief."}]
    text = _prompt_text(template_server, messages=conversation, tools=TOOLS)
    assert '"name": "get_weather"' in text and "<tools>" in text and '"description": "The weather in a city"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n21 degrees\n</tool_response>" in text
    assert "\nsystem\nBe brief.\n" in text   # developer is the system role for templates (special tokens dropped)
    thinking_off = _prompt_text(template_server, messages=ASK, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off.endswith("\nassistant\n<think>\n\n</think>\n\n")
    assert _prompt_text(template_server, messages=ASK).endswith("\nassistant\n")
    assert "tools" in _error(httpx.post(f"{template_server.url}/v1/chat/completions", json={
        "messages": ASK, "chat_template_kwargs": {"tools": []}}, timeout=60))["message"]


def test_auto_tool_choice_needs_the_server_flag(template_server):
    error = _error(httpx.post(f"{template_server.url}/v1/chat/completions",
                              json={"messages": ASK_WEATHER, "tools": TOOLS}, timeout=60))
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]
    answer = httpx.post(f"{template_server.url}/v1/chat/completions", timeout=300, json={
        "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 0})
    for call in answer.json()["choices"][0]["message"]["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


# ---- the llama3_json tool parser, on a server of its own ----

# A Llama 3 answer that is a call: one JSON object with "name" and "parameters", nothing around it.
LLAMA3_CALL = r'\{"name": "get_weather", "parameters": \{"city": "Paris", "unit": "celsius"\}\}'


@pytest.fixture(scope="module")
def llama3_client(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("llama3-server") / "server.log", *FLAGS,
                            "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    yield process.openai_client(300)
    process.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_json_answers_become_tool_calls(llama3_client, stream):
    """A grammar makes the model answer with a Llama 3 JSON call: the server returns it as a tool call (its
    parameters as the arguments), with no content; an answer that only mentions JSON stays content."""
    request = dict(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="auto", max_tokens=60,
                   temperature=0, extra_body={"guided_regex": LLAMA3_CALL})
    if stream:
        calls, content, finish = _streamed(llama3_client, **{k: v for k, v in request.items() if k != "model"})
    else:
        message = llama3_client.chat.completions.create(**request).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in _assert_valid_calls(
            message.message)]
        content, finish = message.message.content or "", message.finish_reason
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert content == "" and finish == "tool_calls"
    text = "The answer is {\"name\": \"x\"}"
    plain = llama3_client.chat.completions.create(**{**request, "extra_body": {"guided_regex": re.escape(text)}})
    assert plain.choices[0].message.content == text and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"
