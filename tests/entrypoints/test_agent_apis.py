"""The Responses and Messages APIs through `pagedllm serve` on loopback, driven by the official openai and
anthropic clients and by the OpenAI Agents SDK; references: jsonschema for arguments and structured text,
the clients' own stream assembly, /metrics for cached tokens, the scheduler's order for priorities.

One server (the bundled model, the shipped Hermes tool template, two tenants, the priority policy, one
running request at a time so that queue order shows, the fault-injection hold) serves the module.
"""
from __future__ import annotations

import asyncio
import json
from importlib import resources

import anthropic
import httpx
import jsonschema
import openai
import pytest

from benchmarks.reliability.fault_markers import FAULT_INJECTION_LAUNCHER
from benchmarks.reliability.faults import PREFILL_WORDS, WORDS, held_prefill
from benchmarks.reliability.fuzz import run_schemathesis
from benchmarks.reliability.suite import FUZZ_SERVER_FLAGS
from pagedllm.bench.server_process import ServerProcess, metric, poll

MODEL = "smollm2"
ADMIN_KEY, ALICE_KEY, BOB_KEY = "admin-key", "alice-key", "bob-key"
STORE_SIZE = 4
# --batch-invariant: a repeated request's prefill is shorter (its prompt hits the prefix cache), and the
# streamed and whole answers compared below must not differ by the matmul path that row count takes. --dtype float32:
# where AVX512-BF16 makes bfloat16 the default, the same greedy request answered differently whole and as a prefix
# hit's tail (found on an AMD EPYC Zen 5; batch invariance covers the matmuls, not the bfloat16 attention paths).
FLAGS = ("--batch-invariant", "--dtype", "float32", "--kv-cache-memory", "1GiB", "--max-model-len", "2048",
         "--max-num-batched-tokens", "512", "--max-num-seqs", "1", "--scheduling-policy", "priority",
         "--served-model-name", MODEL,
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--responses-store-size", str(STORE_SIZE))
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                  "parameters": WEATHER_SCHEMA}
MESSAGES_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
ASK_WEATHER = "What is the weather in Paris?"
CITY_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                "population": {"type": "integer", "minimum": 0},
                                                "coastal": {"type": "boolean"}},
               "required": ["name", "population", "coastal"], "additionalProperties": False}
TIMEOUT = 300
# Anthropic's newer clients have no sampling fields; older ones send temperature, top_p and top_k, honoured here.
GREEDY = {"temperature": 0}
SCHEMATHESIS_EXAMPLES = 15   # per operation and generation mode, as the reliability suite's fuzz test


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent-apis")
    keys = folder / "keys.yaml"
    keys.write_text(f"{ALICE_KEY}: alice\n{BOB_KEY}: bob\n")
    template = resources.files("pagedllm.entrypoints.openai") / "chat_templates" / "chatml_hermes_tools.jinja"
    process = ServerProcess(folder / "server.log", *FLAGS, "--chat-template", str(template),
                            "--api-keys-file", str(keys), api_key=ADMIN_KEY, launcher=FAULT_INJECTION_LAUNCHER)
    yield process
    process.stop()


def _openai(server, key: str = ALICE_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def _anthropic(server, key: str = ALICE_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return _openai(server)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return _anthropic(server)


def _streamed(client: openai.OpenAI, **request) -> tuple[list[str], object]:
    """The stream's event types and the response it assembles into (client.responses.stream's own
    assembly; an incomplete response comes whole in its last event, which the client fills in too)."""
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    return [event.type for event in events], final


def _without_ids(response) -> dict:
    """A response as data, without what differs between two runs of one request: ids, times, and how
    much of the prompt the prefix cache served."""
    data = response.model_dump(mode="json", exclude_none=True)
    data.pop("id"), data.pop("created_at", None)
    for item in data.get("output", []):
        item.pop("id"), item.pop("call_id", None)
    data["usage"]["input_tokens_details"].pop("cached_tokens")
    return data


# ---------------------------------------------------------------- Responses

def test_a_streamed_response_assembles_into_the_whole_one(client):
    request = dict(model=MODEL, input="Name three colours.", instructions="Answer in one line.",
                   max_output_tokens=12, temperature=0, metadata={"run": "1"}, user="u-1")
    whole = client.responses.create(**request)
    types, streamed = _streamed(client, **request)
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert _without_ids(streamed) == _without_ids(whole)
    assert whole.output_text and whole.metadata == {"run": "1"} and whole.instructions == "Answer in one line."
    # Twelve tokens cannot hold the answer: it is incomplete, for that reason.
    assert whole.usage.output_tokens == 12 and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"


def test_a_function_tool_round_trip_chained_by_previous_response_id(client):
    first = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[RESPONSES_TOOL], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert first.status == "completed" and call.name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees and sunny"}
    answer = dict(model=MODEL, tools=[RESPONSES_TOOL], tool_choice="none", max_output_tokens=24, temperature=0)
    chained = client.responses.create(previous_response_id=first.id, input=[result], **answer)
    # Chaining means the whole conversation: the same answer as sending it explicitly.
    explicit = client.responses.create(input=[{"role": "user", "content": ASK_WEATHER},
                                              {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                               "arguments": call.arguments}, result], **answer)
    assert chained.output_text and chained.output_text == explicit.output_text
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.previous_response_id == first.id


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_streamed_function_calls_assemble_into_the_whole_ones(client, tool_choice):
    request = dict(model=MODEL, input=ASK_WEATHER, tools=[RESPONSES_TOOL], tool_choice=tool_choice,
                   max_output_tokens=200, temperature=0)
    whole = client.responses.create(**request)
    types, streamed = _streamed(client, **request)
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    assert _without_ids(streamed) == _without_ids(whole)
    for item in whole.output:
        jsonschema.validate(json.loads(item.arguments), WEATHER_SCHEMA)


def test_text_format_json_schema_output_validates(client):
    response = client.responses.create(model=MODEL, input="Describe Lisbon as JSON.", max_output_tokens=200,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "city",
                                                                       "schema": CITY_SCHEMA, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY_SCHEMA)


def test_stored_responses_are_seen_by_their_tenant_only(server, client):
    made = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
    assert client.responses.retrieve(made.id).output_text == made.output_text
    bob = _openai(server, BOB_KEY)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as chained:
        bob.responses.create(model=MODEL, input="More", previous_response_id=made.id, max_output_tokens=4)
    assert chained.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(made.id)
    with pytest.raises(openai.BadRequestError):   # nothing runs in the background to cancel
        client.responses.cancel(made.id)
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_keeps_its_size_evicting_the_oldest(client):
    ids = [client.responses.create(model=MODEL, input=f"Count {index}", max_output_tokens=2).id
           for index in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(kept).id for kept in ids[1:]] == ids[1:]


REFUSED_RESPONSES_FIELDS = [
    ({"tools": [{"type": "web_search"}]}, "tools.0", "web_search"),
    ({"tools": [RESPONSES_TOOL, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.1", "file_search"),
    ({"background": True}, "background", "background"), ({"truncation": "auto"}, "truncation", "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning.effort"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"), ({"conversation": "conv_1"}, "conversation", "conversation"),
    ({"max_tool_calls": 2}, "max_tool_calls", "max_tool_calls"), ({"top_logprobs": 3}, "top_logprobs", "top_logprobs"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}}, "text.format", "text"),
]


@pytest.mark.parametrize("fields,param,named", REFUSED_RESPONSES_FIELDS)
def test_refused_responses_fields_are_400s_naming_them(server, fields, param, named):
    response = httpx.post(f"{server.url}/v1/responses", headers={"Authorization": f"Bearer {ALICE_KEY}"},
                          json={"model": MODEL, "input": "Hi", **fields}, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and named in error["message"]


def test_no_op_values_are_accepted_everywhere(server):
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    chat_no_ops = {"return_tokens_as_token_ids": False, "truncate_prompt_tokens": None, "add_special_tokens": False,
                   "logits_processors": [], "echo": False, "best_of": 1, "use_beam_search": False, "priority": 0,
                   "documents": None, "continue_final_message": False, "length_penalty": 1.0}
    bodies = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                        **chat_no_ops}),
              ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "add_special_tokens": True, "priority": 0,
                                   "return_tokens_as_token_ids": None, "truncate_prompt_tokens": None}),
              ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "background": False, "include": [],
                                 "truncation": "disabled", "top_logprobs": 0, "max_tool_calls": None,
                                 "service_tier": "auto", "reasoning": {"effort": None}})]
    for path, body in bodies:
        response = httpx.post(f"{server.url}{path}", headers=headers, json={"model": MODEL, **body}, timeout=TIMEOUT)
        assert response.status_code == 200, (path, response.text)


def test_return_tokens_as_token_ids_names_each_token_by_its_id(server, client):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
                   logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**request).choices[0].logprobs.content
    by_id = client.chat.completions.create(**request, extra_body={"return_tokens_as_token_ids": True})
    by_id = by_id.choices[0].logprobs.content
    ids = [int(entry.token.removeprefix("token_id:")) for entry in by_id]
    texts = [httpx.post(f"{server.url}/detokenize", json={"tokens": [token_id]}, timeout=TIMEOUT,
                        headers={"Authorization": f"Bearer {ALICE_KEY}"}).json()["prompt"] for token_id in ids]
    assert texts == [entry.token for entry in plain]
    assert [entry.logprob for entry in by_id] == [entry.logprob for entry in plain]
    assert all(top.token.startswith("token_id:") for entry in by_id for top in entry.top_logprobs)
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True})
    assert all(token.startswith("token_id:") for token in completion.choices[0].logprobs.tokens)


# ---------------------------------------------------------------- Messages

def test_a_streamed_message_assembles_into_the_whole_one(server, claude):
    request = dict(model=MODEL, max_tokens=12, system="Answer in one line.", extra_body=GREEDY,
                   messages=[{"role": "user", "content": "Name three colours."}], metadata={"user_id": "u-1"})
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert types[:2] == ["message_start", "content_block_start"]   # the client passes pings over
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    raw = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": ALICE_KEY}, timeout=TIMEOUT,
                     json={**{k: v for k, v in request.items() if k != "extra_body"}, **GREEDY, "stream": True})
    names = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert [block.model_dump(exclude_none=True) for block in streamed.content] == \
        [block.model_dump(exclude_none=True) for block in whole.content]
    assert streamed.stop_reason == whole.stop_reason == "max_tokens"
    for usage in (whole.usage, streamed.usage):
        assert usage.output_tokens == 12
    assert (whole.usage.input_tokens + whole.usage.cache_read_input_tokens
            == streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens)


def test_stop_sequences_end_with_stop_sequence(claude):
    request = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": "Say hello."}])
    text = claude.messages.create(**request).content[0].text
    word = text.split()[1]
    stopped = claude.messages.create(**request, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]


def test_output_config_format_output_validates(claude):
    message = claude.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Describe Lisbon as JSON."}],
                                     output_config={"format": {"type": "json_schema", "schema": CITY_SCHEMA}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), CITY_SCHEMA)


def test_a_tool_round_trip_and_count_tokens(claude):
    ask = [{"role": "user", "content": ASK_WEATHER}]
    first = claude.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY, messages=ask, tools=[MESSAGES_TOOL],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    [tool_use] = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and tool_use.name == "get_weather"
    jsonschema.validate(tool_use.input, WEATHER_SCHEMA)
    conversation = ask + [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                        "content": "21 degrees and sunny"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=conversation,
                                    tools=[MESSAGES_TOOL], tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=MODEL, messages=conversation, tools=[MESSAGES_TOOL],
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_a_streamed_named_tool_call_assembles_into_the_whole_one(claude):
    request = dict(model=MODEL, max_tokens=200, extra_body=GREEDY, messages=[{"role": "user", "content": ASK_WEATHER}],
                   tools=[MESSAGES_TOOL], tool_choice={"type": "tool", "name": "get_weather"})
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert set(deltas) == {"input_json_delta"}
    strip = [block.model_dump(exclude={"id"}, exclude_none=True) for block in whole.content]
    assert [block.model_dump(exclude={"id"}, exclude_none=True) for block in streamed.content] == strip
    assert streamed.stop_reason == whole.stop_reason == "tool_use"


def test_messages_errors_in_anthropics_shape_and_the_key_header(server, claude):
    url = f"{server.url}/v1/messages"
    missing = httpx.post(url, json={"model": MODEL, "max_tokens": 4, "messages": []}, timeout=TIMEOUT)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert missing.json()["type"] == "error"
    headers = {"x-api-key": ALICE_KEY}
    for body, named in (({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
                        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "messages.0.content.0"),
                        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
                        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                          "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
                        ({"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]},
                         "max_tokens"),
                        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                          "container": "c"}, "container")):
        response = httpx.post(url, json=body, headers=headers, timeout=TIMEOUT)
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
        assert named in response.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                               tool_choice={"type": "any"})   # any tool of no tools
    # cache_control breakpoints (longer TTLs first, as Anthropic requires; tests/entrypoints/test_messages_cache_control.py
    # covers what they pin and the usage they report).
    cached = httpx.post(url, headers=headers, timeout=TIMEOUT, json={
        "model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": "Be brief.",
                                                     "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi",
                                                   "cache_control": {"type": "ephemeral"}}]}]})
    assert cached.status_code == 200, cached.text


# ---------------------------------------------------------------- cached tokens, priority

def _hits(server) -> float:
    return metric(server.metrics_text(), "pagedllm:prefix_cache_hits_total")


def test_cached_tokens_are_the_prefix_cache_hits_on_all_four_apis(server, client, claude):
    document = " ".join(WORDS[index % len(WORDS)] for index in range(200))   # many KV blocks long

    def cached_by(call) -> tuple[int, float]:
        before = _hits(server)
        reported = call()
        return reported, _hits(server) - before

    calls = {
        "completions": lambda: client.completions.create(
            model=MODEL, prompt=f"Completion. {document}", max_tokens=2).usage.prompt_tokens_details.cached_tokens,
        "chat": lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Chat. {document}"}],
            max_tokens=2).usage.prompt_tokens_details.cached_tokens,
        "responses": lambda: client.responses.create(
            model=MODEL, input=f"Responses. {document}", max_output_tokens=2).usage.input_tokens_details.cached_tokens,
        "messages": lambda: claude.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": f"Messages. {document}"}]
        ).usage.cache_read_input_tokens,
    }
    for name, call in calls.items():
        first, first_hits = cached_by(call)
        again, again_hits = cached_by(call)
        assert first == first_hits, name
        assert again == again_hits and again > first, name


def test_a_high_priority_request_overtakes_queued_low_priority_ones(server):
    """While the hold keeps the one running seat, requests queue: two low-priority completions, then a
    mid-priority chat request and a high-priority response. Once the seat frees, the scheduler runs them
    by priority, one at a time, so they finish in that order."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    finished: list[str] = []
    prompt = " ".join(WORDS[index % len(WORDS)] for index in range(PREFILL_WORDS))

    async def send(http: httpx.AsyncClient, name: str, path: str, body: dict) -> None:
        response = await http.post(path, json={"model": MODEL, **body})
        assert response.status_code == 200, response.text
        finished.append(name)

    def waiting() -> float:
        return metric(server.metrics_text(), "pagedllm:num_requests_waiting")

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=TIMEOUT) as http:
            requests = [("low-1", "/v1/completions", {"prompt": "One", "max_tokens": 2, "priority": 5}),
                        ("low-2", "/v1/completions", {"prompt": "Two", "max_tokens": 2, "priority": 5}),
                        ("mid", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Three"}],
                                                         "max_tokens": 2, "priority": 1}),
                        ("high", "/v1/responses", {"input": "Four", "max_output_tokens": 2, "priority": -3})]
            tasks = []
            for count, (name, path, body) in enumerate(requests, start=1):
                tasks.append(asyncio.create_task(send(http, name, path, body)))
                # Each is queued before the next is sent, so arrival order is the listed one.
                await asyncio.to_thread(poll, waiting, lambda value, count=count: value >= count, TIMEOUT)
            release.set()
            await asyncio.gather(*tasks)

    release = asyncio.Event()
    with held_prefill(server, MODEL, prompt) as held:
        assert held
        loop = asyncio.new_event_loop()
        queued = loop.create_task(main())
        loop.run_until_complete(release.wait())
    loop.run_until_complete(queued)   # the hold has ended (its request aborted): the queue runs
    loop.close()
    assert finished == ["high", "mid", "low-1", "low-2"]


# ---------------------------------------------------------------- an agent framework

def test_the_openai_agents_sdk_runs_a_one_tool_agent(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[dict] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append({"city": city})
        return f"It is 21 degrees and sunny in {city}."

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=ALICE_KEY, max_retries=0, timeout=TIMEOUT))
    agent = agents.Agent(name="weather", instructions="Answer with the weather the tool gives.", model=model,
                         tools=[get_weather], model_settings=agents.ModelSettings(
                             tool_choice="get_weather", temperature=0, max_tokens=60))
    result = agents.Runner.run_sync(agent, ASK_WEATHER, max_turns=3)
    assert len(calls) == 1 and calls[0]["city"]
    assert "21" in result.final_output


# ---------------------------------------------------------------- an fcfs server: priority refused, fuzzing

@pytest.fixture(scope="module")
def fcfs_server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("fcfs") / "server.log", *FUZZ_SERVER_FLAGS, api_key=ADMIN_KEY)
    yield process
    process.stop()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2})])
def test_priority_needs_the_priority_policy(fcfs_server, path, body):
    def post(priority: int) -> httpx.Response:
        return httpx.post(f"{fcfs_server.url}{path}", headers=fcfs_server.headers, timeout=TIMEOUT,
                          json={"model": MODEL, **body, "priority": priority})

    refused = post(2)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in refused.json()["error"]["message"]
    assert post(0).status_code == 200


def test_schemathesis_over_the_responses_and_messages_routes(fcfs_server):
    result = run_schemathesis(fcfs_server.url, fcfs_server.headers, SCHEMATHESIS_EXAMPLES, seed=0,
                              request_timeout=TIMEOUT, path_prefixes=("/v1/responses", "/v1/messages"))
    assert result.violations == [], "\n".join(result.violations[:20]) + fcfs_server.log()[-4000:]
    assert result.status_counts.get("2xx") and result.status_counts.get("4xx"), result.status_counts
    still = httpx.post(f"{fcfs_server.url}/v1/messages", headers={"x-api-key": ADMIN_KEY}, timeout=TIMEOUT,
                       json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert still.status_code == 200, still.text
    assert fcfs_server.wait_until_idle().idle
