"""Security basics (reliability issue 7), each shown on the real thing: loopback binding, the API key on
every route but /health, sandboxed chat templates, no code from model folders, no secrets in logs.

The checks live in benchmarks.reliability.security, which the reliability suite runs too; these
tests call them and add what is finer-grained. Two servers are shared by the module: one with the
bundled model and an API key (default host), and one over a tiny model folder whose chat template is
hostile, listening on 0.0.0.0.
"""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import httpx
import jinja2
import pytest

from benchmarks.reliability import security, security_model_files
from benchmarks.reliability.security_check import SecurityCheckFailed
from pagedllm import LLM, SamplingParams
from pagedllm.bench.server_process import ServerProcess
from pagedllm.entrypoints.cli import parse_args
from pagedllm.entrypoints.openai import auth
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.tokenizer import load_tokenizer_from_folder


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("keyed") / "server.log", *security.SERVER_FLAGS,
                           "--max-request-body-bytes", str(security.BODY_LIMIT), api_key=security.new_api_key())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return security_model_files.tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory):
    """Created only if a template attack manages to run a shell command."""
    return tmp_path_factory.mktemp("sentinel") / "template-escaped"


@pytest.fixture(scope="module")
def hostile_model(tiny_model, sentinel, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile") / "model"
    shutil.copytree(tiny_model, folder)
    security_model_files.write_hostile_chat_template(folder, sentinel)
    return folder


@pytest.fixture(scope="module")
def template_server(hostile_model, tmp_path_factory):
    """Also listens on 0.0.0.0, to show --host is honoured without a third server start."""
    server = ServerProcess(tmp_path_factory.mktemp("template") / "server.log", str(hostile_model),
                           *security.SERVER_FLAGS, "--host", "0.0.0.0")
    yield server
    server.stop()


# ---- binding ----

def test_serve_binds_to_loopback_unless_told_otherwise(keyed_server):
    assert ServerConfig().host == "127.0.0.1"
    assert parse_args(["serve"]).server_config.host == "127.0.0.1"
    security.listens_only_on(keyed_server, "127.0.0.1")


def test_host_flag_is_honoured(template_server):
    security.listens_only_on(template_server, "0.0.0.0")


# ---- API key ----

def test_api_key_guards_every_route_but_health(keyed_server):
    """Each route, each near miss (no key, wrong, prefix, extension, Basic scheme, no scheme, scheme
    alone): an OpenAI 401 with a Bearer challenge; "Bearer", "bearer" and "BEARER" with the key pass."""
    routes = security.guarded_routes(keyed_server)
    assert set(security.GUARDED_ROUTES) <= set(routes) and security.OPEN_ROUTE not in routes
    security.api_key_on_every_route(keyed_server)


def test_api_key_is_compared_with_compare_digest():
    security.api_key_compared_in_constant_time()


def test_constant_time_check_catches_a_plain_comparison(monkeypatch):
    """The check above must fail when the key is compared some other way, or it shows nothing."""
    monkeypatch.setattr(auth, "hmac", SimpleNamespace(compare_digest=lambda given, expected: given == expected))
    with pytest.raises(SecurityCheckFailed, match="not compared with compare_digest"):
        security.api_key_compared_in_constant_time()


def test_constant_time_check_catches_a_search_that_stops_at_the_first_match(monkeypatch):
    """With several keys (--api-keys-file), which key matched must not show in the time taken either."""
    def first_match(self, authorization):
        token = authorization.partition(b" ")[2]
        for key, tenant in self.keys:
            if auth.hmac.compare_digest(token, key):
                return True, tenant
        return False, None

    monkeypatch.setattr(auth.APIKeyMiddleware, "_match", first_match)
    with pytest.raises(SecurityCheckFailed, match="not compared with compare_digest against every key"):
        security.api_key_compared_in_constant_time()


# ---- body size: the property's own test is tests/entrypoints/test_server.py::test_oversized_bodies_are_refused_with_413 ----

def test_suite_body_limit_check_passes(keyed_server):
    security.body_size_limit(keyed_server, security.BODY_LIMIT)


# ---- chat templates ----

@pytest.fixture(scope="module")
def hostile_tokenizer(hostile_model):
    return load_tokenizer_from_folder(hostile_model)


@pytest.mark.parametrize("attack", security_model_files.RAISING_ATTACKS)
def test_template_reaching_for_internals_raises_security_error(hostile_tokenizer, sentinel, attack):
    with pytest.raises(jinja2.exceptions.SecurityError):
        hostile_tokenizer.apply_chat_template([{"role": "user", "content": attack}])
    assert not sentinel.exists()


@pytest.mark.parametrize("attack", security_model_files.SILENT_ATTACKS)
def test_template_naming_an_internal_renders_nothing(hostile_tokenizer, attack):
    rendered = hostile_tokenizer.apply_chat_template_text([{"role": "user", "content": attack}])
    assert rendered == "[]"


@pytest.mark.parametrize("template", ["{{ 1 / 0 }}", "{{ 'a' + 1 }}", "{{ messages | bogus_filter }}"])
def test_a_broken_template_is_a_clear_error_not_a_crash(hostile_tokenizer, template):
    with pytest.raises((ValueError, jinja2.TemplateError), match="template|filter"):
        hostile_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template)


def test_hostile_template_gets_400_and_the_server_carries_on(template_server, sentinel):
    security_model_files.chat_templates_sandboxed(template_server, sentinel)


def test_offline_chat_with_hostile_template_raises_clearly(hostile_model, sentinel):
    llm = LLM(str(hostile_model), kv_cache_memory="16MiB", max_model_len=256)
    for attack in ("mro-subclasses", "cycler-globals-os-system"):
        with pytest.raises(jinja2.TemplateError, match="unsafe"):
            llm.chat([{"role": "user", "content": attack}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not sentinel.exists()
    reply = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(reply[0].outputs[0].token_ids) == 2


# ---- remote code ----

def test_code_shipped_in_a_model_folder_is_never_run(tiny_model, tmp_path):
    security_model_files.no_remote_code(tiny_model, tmp_path)
    assert not (tmp_path / "remote-code-ran").exists()


def test_refused_model_code_is_named_in_the_error(tiny_model, tmp_path):
    folder = shutil.copytree(tiny_model, tmp_path / "model")
    security_model_files.with_remote_model_code(folder, tmp_path / "ran", "EvilForCausalLM")
    message = security_model_files.load_error(folder)
    assert "EvilForCausalLM" in message and "never runs" in message


# ---- logs (last: it stops the keyed server) ----

def test_api_keys_stay_out_of_the_log(keyed_server):
    assert keyed_server.api_key not in repr(ServerConfig(api_key=keyed_server.api_key))
    with httpx.Client(base_url=keyed_server.url, timeout=30) as client:
        assert client.get("/v1/models", headers=keyed_server.headers).status_code == 200
        for key in security.wrong_keys(keyed_server.api_key).values():
            assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    keyed_server.stop()
    startup = next(line for line in keyed_server.log().splitlines() if "serving smollm2" in line)
    assert keyed_server.api_key not in startup
    security.no_secrets_in_log(keyed_server)
