"""Property-based fuzzing of a live server's HTTP API.

The property: every answer is a 2xx of the documented shape or a 4xx with OpenAI's error body
({"error": {"message", "type", "param", "code"}}), never a 5xx, a hang or a dropped connection;
and afterwards the server is still up with every KV block back in its pool. Requests come from:

- run_fuzz: the hypothesis strategies of fuzz_requests.py, for completions and chat: odd Unicode, sampling
  fields at and past their limits, wrong types, missing fields, bodies JSON cannot express (NaN).
- run_schemathesis: schemathesis over the server's own /openapi.json, each answer checked against it.

Both record what they find in a FuzzResult instead of raising, so the suite
can print the figures and the tests can assert on them.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok

from benchmarks.reliability.fuzz_answers import answer_problem, cut, error_body_problem
from benchmarks.reliability.fuzz_requests import Target, drawn_requests, fixed_requests
from pagedllm.bench.server_process import EngineFigures

IDLE_TIMEOUT = 30.0   # seconds the engine gets to finish and free its blocks once fuzzing stops


@dataclass
class FuzzResult:
    cases: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)   # "2xx", "4xx", "5xx", "no answer", ...
    violations: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def count(self, outcome: str) -> None:
        self.cases += 1
        self.status_counts[outcome] = self.status_counts.get(outcome, 0) + 1


def _status_class(status: int) -> str:
    return f"{status // 100}xx"


# ---------------------------------------------------------------- running

class _Hang(Exception):
    """The server took longer than the request timeout to answer in full."""


def _exchange(client: httpx.Client, path: str, content: bytes, timeout: float) -> tuple[int, str]:
    """The status and whole body, read against one deadline (a stream that trickles on is a hang too)."""
    deadline = time.monotonic() + timeout
    with client.stream("POST", path, content=content, timeout=timeout) as response:
        parts = []
        for part in response.iter_text():
            parts.append(part)
            if time.monotonic() > deadline:
                raise _Hang
        return response.status_code, "".join(parts)


def _no_answer(result: FuzzResult, shown: str, timeout: float, connection_error: Exception | None = None) -> None:
    """A request that got no answer: a hang (timed out) or a dropped connection (a crash?)."""
    result.count("no answer")
    problem = (f"no answer within {timeout}s (a hang)" if connection_error is None
               else f"connection failed (the server crashed?): {connection_error!r}")
    result.violations.append(f"{shown} -> {problem}")


def _sent_object(content: bytes) -> dict | None:
    """The body as the server's JSON parser reads it (NaN literals too), if it is an object."""
    try:
        value = json.loads(content)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def fire(client: httpx.Client, path: str, body: Any, timeout: float, result: FuzzResult) -> None:
    """Sends one request and records its outcome and any violation."""
    content = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    shown = f"POST {path} {cut(content.decode(errors='replace'))}"
    try:
        status, text = _exchange(client, path, content, timeout)
    except (httpx.TimeoutException, _Hang):
        _no_answer(result, shown, timeout)
        return
    except httpx.TransportError as exc:
        _no_answer(result, shown, timeout, exc)
        return
    result.count(_status_class(status))
    sent = _sent_object(content)
    if 200 <= status < 300 and sent is None:
        problem = "a 2xx for a body that is not a JSON object"
    elif 200 <= status < 300:
        problem = answer_problem(path, sent, text, streamed=sent.get("stream") is True)
    elif 400 <= status < 500:
        problem = error_body_problem(status, text)
    else:
        problem = f"status {status}"
    if problem is not None:
        result.violations.append(f"{shown} -> {status} {cut(text)}: {problem}")


def _run_examples(strategy: st.SearchStrategy, action: Callable[[Any], None], max_examples: int, seed: int) -> None:
    """Calls action on max_examples draws, outside pytest. Nothing raises, so there is nothing to shrink."""
    @hypothesis.seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def run(example: Any) -> None:
        action(example)

    run()


def check_recovered(client: httpx.Client, result: FuzzResult, idle_timeout: float, timeout: float) -> None:
    """After fuzzing the server must still answer, and once idle have every KV block back in its pool."""
    deadline = time.monotonic() + idle_timeout
    try:
        while True:
            response = client.get("/metrics", timeout=timeout)
            response.raise_for_status()
            figures = EngineFigures(response.text)
            if figures.idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except httpx.HTTPError as exc:
        result.violations.append(f"after fuzzing the server does not answer GET /metrics: {exc!r}")
        return
    if not figures.idle:
        result.violations.append(
            f"{idle_timeout}s after fuzzing the engine is not idle: {figures.running:.0f} running, "
            f"{figures.waiting:.0f} waiting, {figures.free_blocks:.0f} of {figures.total_blocks:.0f} KV blocks free")


def run_fuzz(url: str, headers: dict, max_examples: int, seed: int, request_timeout: float,
             idle_timeout: float = IDLE_TIMEOUT) -> FuzzResult:
    """Sends the fixed requests and max_examples hypothesis-drawn completion and chat requests to the
    server, one at a time, then checks that it recovered (see check_recovered)."""
    result = FuzzResult()
    started = time.monotonic()
    with httpx.Client(base_url=url, headers={**headers, "Content-Type": "application/json"}) as client:
        try:
            target = Target.probe(client, request_timeout)
        except (httpx.HTTPError, ValueError, LookupError) as exc:
            result.violations.append(f"the server does not describe itself (GET /v1/models, POST /tokenize): {exc!r}")
        else:
            for path, body in fixed_requests(target):
                fire(client, path, body, request_timeout, result)
            _run_examples(drawn_requests(target), lambda request: fire(client, *request, request_timeout, result),
                          max_examples, seed)
            check_recovered(client, result, idle_timeout, request_timeout)
    result.elapsed_s = time.monotonic() - started
    return result


# ---------------------------------------------------------------- schemathesis

# Checks whose rules the schema can state; positive_data_acceptance is left out: the schema does not
# encode cross-field rules (best_of >= n, prompt + max_tokens <= max_model_len), so valid-looking data gets 400s.
SCHEMATHESIS_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
                       response_schema_conformance, negative_data_rejection]


def _call_and_check(case: schemathesis.Case, url: str, headers: dict, timeout: float, result: FuzzResult) -> None:
    shown = f"{case.operation.label} {cut(repr(case.body))}"
    try:
        response = case.call(base_url=url, headers=headers, timeout=timeout)
    except requests.Timeout:
        _no_answer(result, shown, timeout)
        return
    except requests.ConnectionError as exc:
        _no_answer(result, shown, timeout, exc)
        return
    result.count(_status_class(response.status_code))
    try:
        case.validate_response(response, checks=SCHEMATHESIS_CHECKS, headers=headers)
    except FailureGroup as group:
        titles = "; ".join(failure.title for failure in group.exceptions)
        result.violations.append(f"{shown} -> {response.status_code} {cut(response.text)}: {titles}")


def run_schemathesis(url: str, headers: dict, max_examples: int, seed: int = 0,
                     request_timeout: float = 60.0, path_prefixes: tuple[str, ...] = ("/",)) -> FuzzResult:
    """schemathesis over the server's own /openapi.json: max_examples schema-valid and max_examples
    schema-invalid cases per operation (those under path_prefixes), each answer checked against the
    schema (SCHEMATHESIS_CHECKS)."""
    result = FuzzResult()
    started = time.monotonic()
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers, timeout=request_timeout)
    for loaded in schema.get_all_operations():
        if not isinstance(loaded, Ok):
            result.violations.append(f"an operation of the schema cannot be tested: {loaded.err()}")
            continue
        operation = loaded.ok()
        if not operation.path.startswith(path_prefixes):
            continue
        for mode in GenerationMode:
            try:
                _run_examples(operation.as_strategy(generation_mode=mode),
                              lambda case: _call_and_check(case, url, headers, request_timeout, result),
                              max_examples, seed)
            except Unsatisfiable:
                if mode is GenerationMode.POSITIVE:
                    raise
                # an operation without parameters or body (GET /health) has nothing to make invalid
    result.elapsed_s = time.monotonic() - started
    return result
