"""Tenants and overload on a real `pagedllm serve`: keys from --api-keys-file name tenants whose prefix-cache
blocks are never shared with one another (counted from /metrics), and --max-waiting-requests answers 503
with Retry-After at once instead of queueing without bound.

One server serves the module: two tenants' keys, an admin --api-key, at most one running sequence and
MAX_WAITING waiting requests, run by the fault-injection launcher so that a request can be held mid-prefill.
"""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest

from benchmarks.reliability import faults
from benchmarks.reliability.fault_markers import FAULT_INJECTION_LAUNCHER, HOLD_FAULT
from pagedllm.bench.server_process import ServerProcess, metric, poll
from pagedllm.entrypoints.cli import parse_args

MODEL = "smollm2"
KEYS = {"key-of-alice-0123456789": "alice", "key-of-bob-0123456789": "bob"}
ADMIN_KEY = "admin-key-0123456789"
MAX_WAITING = 3
BLOCK_SIZE = 16
# 10 full blocks and a bit: a shared prefix would show as 160 hit tokens.
PROMPT = " ".join(f"word{i}" for i in range(90))
STEP_TOKENS = 64   # a step's token budget: a prompt of a few hundred tokens takes several steps to prefill


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    keys_file = folder / "keys.yaml"
    keys_file.write_text(json.dumps(KEYS))   # JSON is YAML
    process = ServerProcess(folder / "server.log", "--api-keys-file", str(keys_file), "--max-num-seqs", "1",
                            "--max-waiting-requests", str(MAX_WAITING), "--max-model-len", "2048",
                            "--kv-cache-memory", "128MiB", "--block-size", str(BLOCK_SIZE),
                            "--max-num-batched-tokens", str(STEP_TOKENS), "--served-model-name", MODEL,
                            api_key=ADMIN_KEY, launcher=FAULT_INJECTION_LAUNCHER)
    yield process
    process.stop()


def client_of(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def prefix_hits(server: ServerProcess) -> float:
    return metric(server.wait_until_idle().text, "pagedllm:prefix_cache_hits_total")


def hits_of(server: ServerProcess, key: str, **extra) -> float:
    """Prompt tokens the prefix cache gave one greedy request of PROMPT, sent with this key."""
    before = prefix_hits(server)
    client_of(server, key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                              extra_body=extra or None)
    return prefix_hits(server) - before


def test_tenants_never_share_cached_blocks_and_a_tenant_shares_with_itself(server):
    alice, bob = list(KEYS)
    num_tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT},
                            headers={"Authorization": f"Bearer {alice}"}).json()["count"]
    shared = (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert hits_of(server, alice) == 0                      # first time: nothing cached
    # An attacker with the same prompt, with no salt, with the victim's name, or with the exact salt
    # string the victim's requests are cached under, gets no hit.
    assert hits_of(server, bob) == 0
    assert hits_of(server, bob, cache_salt="alice") == 0
    assert hits_of(server, bob, cache_salt=json.dumps(["alice", None])) == 0
    assert hits_of(server, ADMIN_KEY) == 0                  # a key without a tenant is a tenant of its own
    assert hits_of(server, alice) == shared                 # the owner shares with itself
    assert hits_of(server, bob) == shared                   # and so does bob, with his own blocks now
    # A request's own salt narrows its tenant's sharing further.
    assert hits_of(server, alice, cache_salt="project-x") == 0
    assert hits_of(server, alice, cache_salt="project-x") == shared


def test_a_bad_salt_is_a_400_naming_it(server):
    with pytest.raises(openai.BadRequestError) as error:
        client_of(server, ADMIN_KEY).completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                                        extra_body={"cache_salt": ""})
    assert "cache_salt" in str(error.value)


def test_keys_file_keys_are_checked_like_api_key(server):
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer key-of-carol"}).status_code == 401
    for key in [*KEYS, ADMIN_KEY]:
        assert client_of(server, key).models.list().data[0].id == MODEL


@pytest.mark.parametrize("content", ["[1, 2]", "{}", "{'k': ''}", "not: [valid"])
def test_a_bad_keys_file_stops_the_server_before_it_loads(tmp_path, capsys, content):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "--api-keys-file", str(keys_file)])
    assert exit_info.value.code == 2 and "api_keys_file" in capsys.readouterr().err


def test_past_max_waiting_requests_new_requests_get_503_with_retry_after(server):
    """One request, held by the launcher part-way through its prefill, keeps the only running seat
    (max-num-seqs 1) for as long as the test needs it, so every other request waits: of a burst of
    clients, MAX_WAITING are queued and the rest refused at once with 503 + Retry-After, a streamed one
    too. Once the held request's client leaves, the queued ones finish; no error but those 503s."""
    burst = 8

    async def main() -> tuple[list[httpx.Response], httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                     timeout=120) as http:
            prompt = f"{faults.unique_prompt(random.Random(4), 5 * STEP_TOKENS)} {HOLD_FAULT}"
            long_body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=long_body):
                held = await asyncio.to_thread(poll, lambda: faults.hold_counts(server)["held"], bool, 120)
                assert held, "the launcher never held the long request"
                short = [asyncio.create_task(http.post("/v1/completions", json=short_body(index)))
                         for index in range(burst)]
                while sum(task.done() for task in short) < burst - MAX_WAITING:   # the refusals come first
                    await asyncio.wait([task for task in short if not task.done()],
                                       return_when=asyncio.FIRST_COMPLETED)
                waiting = metric(server.metrics_text(), "pagedllm:num_requests_waiting")
                streamed = await http.post("/v1/completions", json={**short_body(burst), "stream": True})
            # The held stream is closed, which aborts its request and ends the hold: the queued ones run now.
            return [await task for task in short], streamed, waiting

    def short_body(index: int) -> dict:
        return {"model": MODEL, "prompt": f"Short {index}:", "max_tokens": 4}

    responses, streamed, waiting = asyncio.run(main())
    refused = [r for r in responses if r.status_code == 503] + [streamed]
    answered = [r for r in responses if r.status_code == 200]
    assert len(answered) == MAX_WAITING and len(refused) == burst - MAX_WAITING + 1, \
        [r.status_code for r in responses + [streamed]]
    assert all(r.status_code == 503 and r.headers["Retry-After"] == "1"
               and r.json()["error"]["code"] == "server_overloaded" for r in refused)
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in answered)
    assert waiting == MAX_WAITING
    assert server.wait_until_idle().idle
