"""Security basics, each checked against the real thing: `pagedllm serve` processes for what is about
serving, the real middleware and loader for the rest.

- the server binds to loopback unless --host says otherwise;
- --api-key guards every route but /health, compared in constant time;
- request bodies over --max-request-body-bytes get 413, declared or chunked;
- chat templates render in a sandbox: one that reaches for Python internals gets a 400 and runs nothing;
- code shipped in a model folder (auto_map) is never imported;
- neither the API key nor a wrong one shows up in the server's log.

Each check function returns a line of detail when the property holds and raises SecurityCheckFailed
when it does not; run_security_checks turns them into table rows, the tests call them directly.
"""
from __future__ import annotations

import hmac
import json
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import httpx
import psutil
import torch

from pagedllm.bench.reliability.server import ServerProcess
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
ERROR_FIELDS = {"message", "type", "param", "code"}

# Chat-template attacks, chosen by the user message's content. SENTINEL is replaced by a file path:
# the file exists only if an attack ran a shell command.
RAISING_ATTACKS = {
    "mro-subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "cycler-globals-os-system": "{{ cycler.__init__.__globals__.os.system('touch SENTINEL') }}",
    "lipsum-globals-popen": "{{ lipsum.__globals__['os'].popen('touch SENTINEL').read() }}",
    "self-builtins-import": "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch SENTINEL') }}",
    "format-string-attributes": "{{ '{0.__class__.__mro__}'.format('') }}",
    "attr-filter": "{{ (''|attr('__class__')).__mro__ }}",
    "subscript-dunder": "{{ ''['__class__']['__mro__'] }}",
    "namespace-dunder": "{% set ns = namespace() %}{% set ns.__class__ = none %}",
    "mutate-messages": "{{ messages.append(messages) }}",
}
# A lone unsafe attribute is jinja's "undefined": it renders as nothing, and fails on any use (above).
SILENT_ATTACKS = {
    "function-globals": "[{{ raise_exception.__globals__ }}]",
    "format-map-attributes": "[{{ '{x.__class__}'.format_map({'x': ''}) }}]",
}
_PLAIN_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Imported, it leaves proof behind.
_EVIL_MODULE = "import pathlib\npathlib.Path({sentinel!r}).touch()\n"


@dataclass
class SecurityCheck:
    """One row of the suite's table."""
    name: str
    passed: bool
    detail: str


class SecurityCheckFailed(Exception):
    """A security property does not hold; the message says where."""


def require(condition: bool, message: str) -> None:
    """Not `assert`: the checks must also run under python -O."""
    if not condition:
        raise SecurityCheckFailed(message)


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


def run_check(name: str, check: Callable[..., str], *args) -> SecurityCheck:
    """A row: passed with the check's detail, or failed with what broke (an unexpected error included)."""
    try:
        return SecurityCheck(name, True, check(*args))
    except Exception as exc:   # a broken check is a failed row, not a crashed suite
        detail = str(exc) if isinstance(exc, SecurityCheckFailed) else f"{type(exc).__name__}: {exc}"
        return SecurityCheck(name, False, detail)


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
    owners = [hmac, secrets, *([auth] if hasattr(auth, "compare_digest") else [])]
    with ExitStack() as patches:
        for owner in owners:
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


# ---- chat templates ----

def hostile_chat_template(sentinel: Path) -> str:
    """One template holding every attack, chosen by the last message's content; any other content
    gets a plain ChatML rendering, so the same server shows it still answers."""
    attacks = {name: body.replace("SENTINEL", str(sentinel))
               for name, body in {**RAISING_ATTACKS, **SILENT_ATTACKS}.items()}
    branches = "".join(f"{{% {'elif' if index else 'if'} attack == {name!r} %}}{body}"
                       for index, (name, body) in enumerate(attacks.items()))
    return f"{{% set attack = messages[-1]['content'] %}}{branches}{{% else %}}{_PLAIN_CHATML}{{% endif %}}"


def write_hostile_chat_template(model_dir: Path, sentinel: Path) -> None:
    """Into tokenizer_config.json, where most Hub models keep theirs (a chat_template.jinja would win)."""
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = hostile_chat_template(sentinel)
    config_path.write_text(json.dumps(config, indent=2))


def chat_templates_sandboxed(server: ServerProcess, sentinel: Path) -> str:
    """Raising attacks get an OpenAI 400 (chat and /tokenize), silent ones render nothing, no command
    runs, a client cannot send its own template, and the server still answers a plain chat."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        for attack in RAISING_ATTACKS:
            messages = [{"role": "user", "content": attack}]
            for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
                               ("/tokenize", {"messages": messages})):
                response = client.post(path, json=body)
                error = response.json().get("error", {}) if response.status_code == 400 else {}
                require(set(error) == ERROR_FIELDS and error["type"] == "invalid_request_error",
                        f"attack {attack!r} on {path}: {response.status_code} {response.text[:200]}")
        for attack in SILENT_ATTACKS:
            rendered = rendered_chat(client, [{"role": "user", "content": attack}])
            require(rendered == "[]", f"attack {attack!r} rendered {rendered[:200]!r}, expected '[]'")
        require(not sentinel.exists(), f"a template attack ran a command: {sentinel} exists")
        plain = [{"role": "user", "content": "hello"}]
        injected = client.post("/tokenize", json={"messages": plain, "chat_template": "INJECTED"}).json()
        require(injected["tokens"] == client.post("/tokenize", json={"messages": plain}).json()["tokens"],
                "a chat_template sent by the client changed the rendering")
        answer = client.post("/v1/chat/completions", json={"messages": plain, "max_tokens": 2})
        require(answer.status_code == 200, f"a plain chat after the attacks: {answer.status_code} {answer.text[:200]}")
    return (f"{len(RAISING_ATTACKS)} attacks refused with 400, {len(SILENT_ATTACKS)} rendered empty, "
            "nothing ran, the server still answers")


def rendered_chat(client: httpx.Client, messages: list[dict]) -> str:
    """The server's rendering of a conversation, read back through /tokenize and /detokenize."""
    tokens = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    require(tokens.status_code == 200, f"/tokenize: {tokens.status_code} {tokens.text[:200]}")
    return client.post("/detokenize", json={"tokens": tokens.json()["tokens"]}).json()["prompt"]


# ---- remote code ----

def tiny_model_dir(folder: Path) -> Path:
    """A seeded two-layer Llama with random weights and the bundled tokenizer: a real model folder,
    made in seconds, whose files the checks can then tamper with."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pagedllm.model.loader import bundled_model_path
    from pagedllm.tokenizer import load_tokenizer_from_gguf

    tokenizer = load_tokenizer_from_gguf(bundled_model_path()).hf
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def with_remote_model_code(model_dir: Path, sentinel: Path, architecture: str) -> Path:
    """config.json points auto_map at modeling_evil.py, which touches sentinel when imported."""
    (model_dir / "modeling_evil.py").write_text(_EVIL_MODULE.format(sentinel=str(sentinel)))
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir


def with_remote_tokenizer_code(model_dir: Path, sentinel: Path) -> Path:
    """tokenizer_config.json names a tokenizer class that only tokenization_evil.py defines."""
    (model_dir / "tokenization_evil.py").write_text(_EVIL_MODULE.format(sentinel=str(sentinel)))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "EvilTokenizer"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]}
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir


def load_error(model_dir: Path) -> str | None:
    """Why loading the folder failed, or None if it loaded."""
    from pagedllm.model.loader import load_checkpoint

    try:
        load_checkpoint(str(model_dir))
    except (ValueError, OSError) as exc:
        return str(exc)
    return None


def no_remote_code(model_dir: Path, workdir: Path) -> str:
    """Model code in an unsupported architecture's auto_map is refused, a supported architecture loads
    without its auto_map, custom tokenizer code is refused, and none of the shipped code is imported."""
    sentinel = workdir / "remote-code-ran"

    def variant(name: str) -> Path:
        return shutil.copytree(model_dir, workdir / name, dirs_exist_ok=True)

    unsupported = load_error(with_remote_model_code(variant("unsupported"), sentinel, "EvilForCausalLM"))
    require(unsupported is not None and "auto_map" in unsupported,
            f"a model whose code ships in its folder: {unsupported or 'it loaded'}")
    supported = load_error(with_remote_model_code(variant("supported"), sentinel, "LlamaForCausalLM"))
    require(supported is None, f"a Llama with an auto_map did not load: {supported}")
    tokenizer = load_error(with_remote_tokenizer_code(variant("tokenizer"), sentinel))
    require(tokenizer is not None and "custom code" in tokenizer,
            f"a tokenizer whose code ships in its folder: {tokenizer or 'it loaded'}")
    require(not sentinel.exists(), "code shipped in a model folder was imported")
    return "shipped model and tokenizer code is refused, never imported"


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
