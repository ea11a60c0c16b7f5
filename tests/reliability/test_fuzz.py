"""Property-based fuzzing of the HTTP API (reliability issue 7): every answer is a 2xx of OpenAI's
shape or a 4xx with OpenAI's error body, never a 5xx, a hang or a crash; afterwards the server still
serves the same greedy answer and its KV pool is whole.

The fuzzers live in benchmarks.reliability.fuzz, which the reliability suite runs too. Their
checks are first run against a stub server that misbehaves on purpose, one way at a time, so that a
clean run against the real server means something. Then SamplingParams is fuzzed directly, and one
real server (the suite's fuzzing flags: a 128-token context keeps every answer short) is fuzzed by
schemathesis and by run_fuzz.
"""
from __future__ import annotations

import dataclasses
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.reliability.fuzz import FuzzResult, run_fuzz, run_schemathesis
from benchmarks.reliability.fuzz_requests import COMPLETION_FIELDS, HUGE_INTS, ODD_FLOATS, WRONG_TYPE
from benchmarks.reliability.suite import FUZZ_SERVER_FLAGS, MODEL
from pagedllm import SamplingParams
from pagedllm.bench.server_process import ServerProcess, free_port
from pagedllm.sampling_params import INT64_MAX, INT64_MIN, MAX_SAMPLES, RequestOutputKind

SEED = 0
FUZZ_EXAMPLES = 200
SCHEMATHESIS_EXAMPLES = 15   # per operation and generation mode (schema-valid, schema-invalid)
REQUEST_TIMEOUT = 60.0
SERVER_FLAGS = FUZZ_SERVER_FLAGS
SERVER_API_KEY = "fuzz-key"
GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def _report(result: FuzzResult, server: ServerProcess | None = None) -> str:
    lines = [f"{result.cases} cases, {result.status_counts}, {len(result.violations)} violations:",
             *result.violations[:20]]
    if server is not None:
        lines.append(f"server log (end):\n{server.log()[-4000:]}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the checks catch each failure

OPENAI_ERROR = {"error": {"message": "refused", "type": "invalid_request_error", "param": None, "code": None}}
STUB_METRICS = ("pagedllm:num_requests_running 0\npagedllm:num_requests_waiting 0\n"
                "pagedllm:kv_cache_total_blocks 10\npagedllm:kv_cache_free_blocks {free}\n")
STUB_SCHEMA = {"openapi": "3.0.3", "info": {"title": "stub", "version": "1"}, "paths": {"/v1/completions": {"post": {
    "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
    "responses": {status: {"description": status, "content": {"application/json": {"schema": {"type": "object"}}}}
                  for status in ("200", "4XX")}}}}}
# Seconds the fuzzer waits for a stub's answer: a local stub answers in milliseconds, even on a loaded core,
# and the stub's hang lasts until the test ends; so this is the time the hang case costs, not a guess.
STUB_TIMEOUT = 5.0


class StubHandler(BaseHTTPRequestHandler):
    """Answers what run_fuzz needs to start; refuses every generation request with a proper 400,
    except the first, which gets the server's fault."""

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "stub", "max_model_len": 64}]})
        elif self.path == "/metrics":
            free = 9 if self.server.fault == "leaked block" else 10
            self._send(200, STUB_METRICS.format(free=free).encode(), "text/plain")
        else:
            self._send(200, STUB_SCHEMA)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/tokenize":
            self._send(200, {"count": 10, "max_model_len": 64, "tokens": [1] * 10})
            return
        with self.server.lock:
            fault, self.server.fault_pending = (self.server.fault if self.server.fault_pending else None), False
        if fault == "hang":
            self.server.hang_over.wait()
        if fault == "dropped connection":
            self.close_connection = True   # no answer at all
        elif fault == "5xx":
            self._send(500, {**OPENAI_ERROR, "error": {**OPENAI_ERROR["error"], "type": "server_error"}})
        elif fault == "non-OpenAI error body":
            self._send(400, {"detail": "refused"})
        elif fault == "malformed answer":
            self._send(200, {"choices": []})
        else:
            self._send(400, OPENAI_ERROR)

    def _send(self, status: int, body: dict | bytes, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


class StubServer(ThreadingHTTPServer):
    daemon_threads = True   # a hanging handler must not hold up the test's end

    def __init__(self, fault: str):
        super().__init__(("127.0.0.1", 0), StubHandler)
        self.fault, self.fault_pending, self.lock = fault, True, threading.Lock()
        self.hang_over = threading.Event()   # set when the test ends

    def handle_error(self, request, client_address) -> None:
        pass   # the hang's late answer finds its client gone


@pytest.fixture
def stub(request):
    server = StubServer(request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.hang_over.set()
    server.shutdown()
    server.server_close()


FAULTS = {
    "none": None,
    "5xx": "status 500",
    "hang": "no answer within",
    "dropped connection": "connection failed",
    "non-OpenAI error body": "the error body is not",
    "malformed answer": "not OpenAI's shape",
    "leaked block": "9 of 10 KV blocks free",
}


@pytest.mark.parametrize("stub", FAULTS, indirect=True)
def test_run_fuzz_records_a_single_misbehaving_answer(stub, request):
    result = run_fuzz(stub, {}, max_examples=5, seed=SEED, request_timeout=STUB_TIMEOUT, idle_timeout=0.5)
    expected = FAULTS[request.node.callspec.params["stub"]]
    if expected is None:
        assert result.violations == [] and result.status_counts == {"4xx": result.cases}, _report(result)
    else:
        assert len(result.violations) == 1 and expected in result.violations[0], _report(result)


def test_run_fuzz_records_a_dead_server():
    result = run_fuzz(f"http://127.0.0.1:{free_port()}", {}, max_examples=5, seed=SEED, request_timeout=STUB_TIMEOUT)
    assert len(result.violations) == 1 and "does not describe itself" in result.violations[0]


@pytest.mark.parametrize("stub", ["5xx"], indirect=True)
def test_run_schemathesis_records_a_server_error(stub):
    result = run_schemathesis(stub, {}, max_examples=5, seed=SEED, request_timeout=STUB_TIMEOUT)
    assert len(result.violations) == 1 and "Server error" in result.violations[0], _report(result)


# ---------------------------------------------------------------- SamplingParams

def _any_value(name: str) -> st.SearchStrategy:
    """What the HTTP fuzzer sends for the field, plus what only Python callers can pass."""
    python_only = st.one_of(st.sampled_from(RequestOutputKind), st.tuples(st.text(max_size=3)), st.just(10**5000),
                            st.sets(st.integers(0, 3), max_size=2), st.binary(max_size=3), st.builds(object))
    fuzzed = COMPLETION_FIELDS.get(name)
    if fuzzed is None:
        return st.one_of(WRONG_TYPE, HUGE_INTS, ODD_FLOATS, python_only)
    return st.one_of(fuzzed.valid, fuzzed.edge, WRONG_TYPE, python_only)


SAMPLING_KWARGS = st.fixed_dictionaries(
    {}, optional={field.name: _any_value(field.name) for field in dataclasses.fields(SamplingParams)})


@settings(max_examples=400, deadline=None)
@given(SAMPLING_KWARGS)
def test_sampling_params_construct_or_refuse_naming_the_field(kwargs):
    """The server turns a refusal into a 400 whose param is the message's first word, so it must name
    a field the caller set; and what constructs must be safe for the sampler's int64 tensors."""
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        assert str(exc).split(" ", 1)[0] in kwargs, f"{exc!r} names none of {sorted(kwargs)}"
        return
    assert 1 <= params.n <= (params.best_of or params.n) <= MAX_SAMPLES
    assert params.seed is None or INT64_MIN <= params.seed <= INT64_MAX
    assert 0 <= params.top_k <= INT64_MAX
    assert all(isinstance(stop, str) and stop for stop in params.stop)
    assert all(isinstance(token_id, int) and token_id >= 0 for token_id in params.stop_token_ids)
    assert all(math.isfinite(value) for value in (params.temperature, params.top_p, params.min_p,
                                                  params.repetition_penalty, params.presence_penalty,
                                                  params.frequency_penalty))


# ---------------------------------------------------------------- the real server

@pytest.fixture(scope="module")
def greedy_before(server) -> dict:
    """The greedy answer before any fuzzing (its prompt is under one KV block: no prefix cache in play)."""
    response = httpx.post(f"{server.url}/v1/completions", json=GREEDY, headers=server.headers, timeout=REQUEST_TIMEOUT)
    response.raise_for_status()
    return response.json()["choices"][0]


@pytest.fixture(scope="module")
def schemathesis_result(server, greedy_before):
    return run_schemathesis(server.url, server.headers, SCHEMATHESIS_EXAMPLES, seed=SEED,
                            request_timeout=REQUEST_TIMEOUT)


@pytest.fixture(scope="module")
def fuzz_result(server, greedy_before):
    return run_fuzz(server.url, server.headers, FUZZ_EXAMPLES, SEED, REQUEST_TIMEOUT)


def test_schemathesis_against_the_servers_own_schema(server, schemathesis_result):
    result = schemathesis_result
    assert result.violations == [], _report(result, server)
    assert result.status_counts.get("2xx") and result.status_counts.get("4xx"), _report(result)


def test_generated_completion_and_chat_requests(server, fuzz_result):
    result = fuzz_result
    assert result.violations == [], _report(result, server)
    # Not vacuous: requests were both served and refused.
    assert result.status_counts.get("2xx", 0) >= 10 and result.status_counts.get("4xx", 0) >= 10, _report(result)


def test_after_fuzzing_the_same_greedy_answer_and_a_whole_kv_pool(server, greedy_before, schemathesis_result,
                                                                  fuzz_result):
    """Runs after both fuzzers whatever the order or selection of tests (it asks for their results)."""
    response = httpx.post(f"{server.url}/v1/completions", json=GREEDY, headers=server.headers, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0] == greedy_before
    figures = server.wait_until_idle(timeout=30)
    assert figures.idle, f"{figures.running} running, {figures.waiting} waiting, " \
                         f"{figures.free_blocks} of {figures.total_blocks} KV blocks free"
