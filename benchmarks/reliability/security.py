"""Security basics, each checked against the real thing: `pagedllm serve` processes for what is about
serving, the real middleware and loader for the rest.

- the server binds to loopback unless --host says otherwise;
- --api-key guards every route but /health, compared in constant time;
- request bodies over --max-request-body-bytes get 413, declared or chunked;
- chat templates render in a sandbox: one that reaches for Python internals gets a 400 and runs nothing;
- code shipped in a model folder (auto_map) is never imported;
- neither the API key nor a wrong one shows up in the server's log.

Each check function returns a line of detail when the property holds and raises SecurityCheckFailed
when it does not (security_check.py); run_security_checks turns them into table rows, the tests call them
directly. The checks on model folders (templates, shipped code) are in security_model_files.py.
"""
from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import httpx
import psutil

from benchmarks.reliability.security_check import ERROR_FIELDS, SecurityCheck, require, run_check
from benchmarks.reliability.security_model_files import (chat_templates_sandboxed, no_remote_code, tiny_model_dir,
                                                         write_hostile_chat_template)
from pagedllm.bench.server_process import ServerProcess
from pagedllm.entrypoints.openai import auth

MODEL_NAME = "smollm2"
SERVER_FLAGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "256", "--served-model-name", MODEL_NAME)
BODY_LIMIT = 64 * 1024
# Named so that a route the app forgot to list in its OpenAPI schema is still tried.
ANTHROPIC_ROUTES = "/v1/messages"   # these answer in Anthropic's error shape
GUARDED_ROUTES = (
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc"),
    ("GET", "/metrics"), ("GET", "/version"), ("GET", "/v1/models"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("GET", "/no-such-route"),
)
OPEN_ROUTE = ("GET", "/health")

def run_security_checks(workdir: Path) -> list[SecurityCheck]:
    """Every check, as rows; servers are shared between the checks that need the same one."""
    workdir.mkdir(parents=True, exist_ok=True)
    checks = [run_check("API key compared in constant time", api_key_compared_in_constant_time)]
    model_dir = tiny_model_dir(workdir / "tiny-model")
    checks.append(run_check("no remote code", no_remote_code, model_dir, workdir / "remote-code"))

    api_key = new_api_key()
    keyed = ServerProcess(workdir / "keyed-server.log", *SERVER_FLAGS,
                          "--max-request-body-bytes", str(BODY_LIMIT), api_key=api_key)
    try:
        checks += [run_check("binds to loopback by default", listens_only_on, keyed, "127.0.0.1"),
                   run_check("API key on every route but /health", api_key_on_every_route, keyed),
                   run_check("request body size limit", body_size_limit, keyed, BODY_LIMIT)]
    finally:
        keyed.stop()
    checks.append(run_check("no secrets in logs", no_secrets_in_log, keyed))

    sentinel = workdir / "template-escaped"
    write_hostile_chat_template(model_dir, sentinel)
    hostile = ServerProcess(workdir / "template-server.log", str(model_dir), *SERVER_FLAGS, "--host", "0.0.0.0")
    try:
        checks += [run_check("--host is honoured", listens_only_on, hostile, "0.0.0.0"),
                   run_check("chat templates sandboxed", chat_templates_sandboxed, hostile, sentinel)]
    finally:
        hostile.stop()
    return checks


# ---- binding ----

def listens_only_on(server: ServerProcess, host: str) -> str:
    """The server process's listening sockets, as the kernel reports them."""
    addresses = {conn.laddr.ip for conn in psutil.Process(server.process.pid).net_connections(kind="inet")
                 if conn.status == psutil.CONN_LISTEN}
    require(addresses == {host}, f"the server listens on {sorted(addresses)}, expected only {host}")
    return f"listening on {host} only"


# ---- API key ----

def new_api_key() -> str:
    return f"sk-pagedllm-{secrets.token_hex(16)}"


def wrong_keys(api_key: str) -> dict[str, str]:
    """Derived from the key, so a log can be searched afterwards for exactly the keys that were sent."""
    return {"wrong key": api_key[::-1], "prefix of the key": api_key[:-1], "key plus one character": f"{api_key}0"}


def refused_authorizations(api_key: str) -> dict[str, tuple[dict[str, str], str]]:
    """{case: (headers, expected error code)}: near misses must fail like plain wrong keys."""
    wrong = {
        **{case: f"Bearer {key}" for case, key in wrong_keys(api_key).items()},
        "key in the Basic scheme": f"Basic {api_key}",
        "key without a scheme": api_key,
        "scheme without a key": "Bearer",
    }
    return {"no Authorization header": ({}, "missing_api_key"),
            **{case: ({"Authorization": value}, "invalid_api_key") for case, value in wrong.items()}}


def accepted_authorizations(api_key: str) -> dict[str, dict[str, str]]:
    """The auth scheme is case-insensitive (RFC 7235); OpenAI's clients send "Bearer"."""
    return {scheme: {"Authorization": f"{scheme} {api_key}"} for scheme in ("Bearer", "bearer", "BEARER")}


def guarded_routes(server: ServerProcess) -> list[tuple[str, str]]:
    """GUARDED_ROUTES and every operation in the app's OpenAPI schema, so a new route is covered too."""
    spec = httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=30).json()
    listed = {(method.upper(), path) for path, operations in spec["paths"].items() for method in operations}
    return sorted((listed | set(GUARDED_ROUTES)) - {OPEN_ROUTE})


def api_key_on_every_route(server: ServerProcess) -> str:
    """Every route but /health refuses each near miss with an OpenAI 401; the right key gets through."""
    routes = guarded_routes(server)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for method, path in routes:
            for case, (headers, code) in refused_authorizations(server.api_key).items():
                response = client.request(method, path, headers=headers, json={} if method == "POST" else None)
                require_auth_error(response, code, f"{method} {path} with {case}",
                                   anthropic=path.startswith(ANTHROPIC_ROUTES))
        for case, headers in accepted_authorizations(server.api_key).items():
            response = client.get("/v1/models", headers=headers)
            require(response.status_code == 200, f"GET /v1/models with {case} {server.api_key!r}: "
                                                  f"{response.status_code}")
        unknown = client.get("/no-such-route", headers=server.headers)
        require(unknown.status_code == 404 and set(unknown.json().get("error", {})) == ERROR_FIELDS,
                f"GET /no-such-route with the key: {unknown.status_code} {unknown.text[:200]}")
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            health = client.get("/health", headers=headers)
            require(health.status_code == 200, f"GET /health with headers {headers}: {health.status_code}")
    kinds = len(refused_authorizations(server.api_key))
    return f"{len(routes)} routes refuse {kinds} kinds of bad credentials; /health is open"


def require_auth_error(response: httpx.Response, code: str, what: str, anthropic: bool = False) -> None:
    """A 401 with OpenAI's error body (Anthropic's on its routes) and a Bearer challenge, echoing none of
    the credentials sent."""
    require(response.status_code == 401, f"{what}: got {response.status_code}, expected 401")
    body = response.json()
    error = body.get("error", {})
    if anthropic:
        require(body.get("type") == "error" and set(error) == {"type", "message"}
                and error["type"] == "authentication_error",
                f"{what}: not an Anthropic authentication error: {response.text[:200]}")
    else:
        require(set(error) == ERROR_FIELDS and error["type"] == "authentication_error" and error["code"] == code,
                f"{what}: not an OpenAI authentication error with code {code}: {response.text[:200]}")
    require(response.headers.get("www-authenticate") == "Bearer", f"{what}: no 'WWW-Authenticate: Bearer'")
    authorization = response.request.headers.get("authorization", "")
    for sent in (authorization, authorization.partition(" ")[2]):
        require(len(sent) < 8 or sent not in response.text, f"{what}: the error echoes the credentials")


def api_key_compared_in_constant_time() -> str:
    """The real middleware over a one-route app with two keys (one a tenant's), compare_digest spied on:
    each request's key must go through it against every key, matching or not (timing itself is too
    noisy to measure in a check)."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    keys = {new_api_key(): None, new_api_key(): "tenant"}
    calls = []
    real_compare = hmac.compare_digest

    def spy(given, expected):
        calls.append((given, expected))
        return real_compare(given, expected)

    app = Starlette(routes=[Route("/v1/models", lambda request: PlainTextResponse("ok"))])
    client = TestClient(auth.APIKeyMiddleware(app, keys=keys))
    with ExitStack() as patches:   # the standard library's functions: pagedllm itself is never patched
        for owner in (hmac, secrets):
            patches.enter_context(mock.patch.object(owner, "compare_digest", spy))
        for sent, status in [(key, 200) for key in keys] + [(new_api_key(), 401)]:
            calls.clear()
            response = client.get("/v1/models", headers={"Authorization": f"Bearer {sent}"})
            require(response.status_code == status, f"key {'right' if status == 200 else 'wrong'}: "
                                                    f"{response.status_code}, expected {status}")
            for key in keys:
                require(any(sorted(call) == sorted((sent.encode(), key.encode())) for call in calls),
                        "the API key was not compared with compare_digest against every key")
    return f"every key is checked against all {len(keys)} keys with compare_digest"


# ---- body size ----

def body_size_limit(server: ServerProcess, limit: int) -> str:
    """A body one byte over the limit gets 413 whether its size is declared or it comes chunked."""
    too_big = json.dumps({"prompt": "a" * limit}).encode()
    headers = {**server.headers, "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        declared = client.post("/tokenize", content=too_big)
        chunked = client.post("/tokenize", content=chunks(too_big, 8 * 1024))
        fits = client.post("/tokenize", json={"prompt": "a" * (limit // 2)})
    for how, response in (("with Content-Length", declared), ("chunked", chunked)):
        require(response.status_code == 413 and response.json()["error"]["code"] == "request_too_large",
                f"a {len(too_big)}-byte body {how}: {response.status_code} {response.text[:200]}")
    require(fits.status_code == 200, f"a body under the limit: {fits.status_code} {fits.text[:200]}")
    return f"bodies over {limit} bytes get 413, declared or chunked"


def chunks(data: bytes, size: int) -> Iterator[bytes]:
    """A generator body: httpx sends it chunked, without a Content-Length."""
    for start in range(0, len(data), size):
        yield data[start:start + size]


# ---- logs ----

def no_secrets_in_log(server: ServerProcess) -> str:
    """Read after the server has stopped, so its shutdown lines count too; every key the checks sent
    (right or wrong) must be absent, while the requests themselves are logged."""
    require(server.process.poll() is not None, "the server must be stopped before its log is read")
    log = server.log()
    sent = {"the API key": server.api_key, **wrong_keys(server.api_key)}
    leaked = [case for case, key in sent.items() if key in log]
    require(not leaked, f"the server's log holds {', '.join(leaked)}")
    require('" 401' in log, "the log shows no refused request: the check would prove nothing")
    return f"none of {len(sent)} keys in {len(log.splitlines())} log lines"
