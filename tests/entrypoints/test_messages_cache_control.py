"""Anthropic's cache_control through `pagedllm serve` on loopback, driven by the official anthropic client: the
usage split (cache_creation / cache_read / input tokens) against counts computed by hand from the ChatML text and
transformers' tokenizer of the bundled GGUF, a pinned prefix surviving filler traffic that evicts an equal
unpinned one (observed through the prefix-cache hits the server reports and its pinned-blocks gauge), and the
400s for bad cache_control values.

The server's KV pool is small, so that a few filler requests evict every idle cached block.
"""
from __future__ import annotations

import random
from importlib import resources

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from benchmarks.reliability.faults import unique_prompt
from pagedllm.bench.server_process import ServerProcess, metric

MODEL = "smollm2"
BLOCK_SIZE = 16   # the server's default block size
MAX_PINNED_FRACTION = 0.5
TIMEOUT = 300
GREEDY = {"temperature": 0}
# The Hermes ChatML template, as the server renders it without tools.
SYSTEM_TURN = "<|im_start|>system\n{}<|im_end|>\n"
USER_TURN = "<|im_start|>user\n{}<|im_end|>\n"
GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = resources.files("pagedllm.entrypoints.openai") / "chat_templates" / "chatml_hermes_tools.jinja"
    process = ServerProcess(tmp_path_factory.mktemp("cache-control") / "server.log", "--served-model-name", MODEL,
                            "--kv-cache-memory", "32MiB", "--max-model-len", "2048", "--max-num-seqs", "1",
                            "--max-pinned-kv-cache-fraction", str(MAX_PINNED_FRACTION), "--chat-template", str(template))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def tokenizer(bundled_gguf_path):
    """transformers' own tokenizer of the bundled GGUF: the reference for token counts."""
    return AutoTokenizer.from_pretrained(bundled_gguf_path.parent, gguf_file=bundled_gguf_path.name)


def num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def full_blocks(num: int) -> int:
    return num // BLOCK_SIZE * BLOCK_SIZE


def gauge(server, name: str) -> float:
    return metric(server.metrics_text(), f"pagedllm:{name}")


def conversation(tokenizer, seed: int) -> tuple[dict, int, int]:
    """A request whose system block (1h) and user block (5m) are breakpoints, and its hand-computed prompt length
    and breakpoint prefix (the user turn's end). The user text grows until the generation prompt's tokens do not
    complete another block, so that a repeat's prefix-cache hit (every full block but the last token's) is the
    pinned prefix exactly."""
    rng = random.Random(seed)
    system = f"Case {rng.randrange(10**9)}. You answer in one word."   # no two cases share a first block
    words = 40
    while True:
        user = unique_prompt(rng, words)
        prefix = num_tokens(tokenizer, SYSTEM_TURN.format(system) + USER_TURN.format(user))
        prompt = num_tokens(tokenizer, SYSTEM_TURN.format(system) + USER_TURN.format(user) + GENERATION_PROMPT)
        if full_blocks(prompt - 1) == full_blocks(prefix):
            break
        words += 1
    request = dict(model=MODEL, max_tokens=2, extra_body=GREEDY,
                   system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                   messages=[{"role": "user", "content": [{"type": "text", "text": user,
                                                           "cache_control": {"type": "ephemeral"}}]}])
    return request, prompt, prefix


def split(usage) -> tuple[int, int, int]:
    return usage.cache_creation_input_tokens, usage.cache_read_input_tokens, usage.input_tokens


def test_usage_splits_the_prompt_into_written_read_and_the_rest(server, claude, tokenizer):
    request, prompt, prefix = conversation(tokenizer, seed=1)
    assert claude.messages.count_tokens(**{k: v for k, v in request.items()
                                           if k not in ("max_tokens", "extra_body")}).input_tokens == prompt
    pinned_before = gauge(server, "kv_cache_pinned_blocks")
    first = claude.messages.create(**request)
    written = full_blocks(prefix)
    assert written >= 2 * BLOCK_SIZE
    assert split(first.usage) == (written, 0, prompt - written)
    # Both breakpoints' blocks are pinned: the system turn's are the user turn's first ones.
    assert gauge(server, "kv_cache_pinned_blocks") - pinned_before == written // BLOCK_SIZE
    again = claude.messages.create(**request)
    assert split(again.usage) == (0, written, prompt - written)
    with claude.messages.stream(**request) as stream:
        start = next(event for event in stream if event.type == "message_start")
        streamed = stream.get_final_message()
    assert split(start.message.usage) == split(streamed.usage) == (0, written, prompt - written)
    # Streamed first: the written tokens come in message_start already.
    other, other_prompt, other_prefix = conversation(tokenizer, seed=2)
    with claude.messages.stream(**other) as stream:
        start = next(event for event in stream if event.type == "message_start")
        streamed = stream.get_final_message()
    expected = (full_blocks(other_prefix), 0, other_prompt - full_blocks(other_prefix))
    assert split(start.message.usage) == split(streamed.usage) == expected


def test_the_top_level_cache_control_marks_the_last_block(server, claude, tokenizer):
    request, prompt, prefix = conversation(tokenizer, seed=3)
    system, user = request["system"][0]["text"], request["messages"][0]["content"][0]["text"]
    plain = dict(request, system=system, messages=[{"role": "user", "content": user}])
    assert split(claude.messages.create(**plain).usage) == (0, 0, prompt)   # no breakpoint: nothing written
    assert claude.messages.count_tokens(model=MODEL, system=system, messages=plain["messages"],
                                        cache_control={"type": "ephemeral"}).input_tokens == prompt
    marked = claude.messages.create(**plain, cache_control={"type": "ephemeral"})
    # The first request cached the blocks already: read, and nothing left to write.
    assert split(marked.usage) == (0, full_blocks(prefix), prompt - full_blocks(prefix))


def test_a_pinned_prefix_survives_filler_traffic_that_evicts_an_unpinned_one(server, claude, tokenizer):
    pinned, prompt, prefix = conversation(tokenizer, seed=4)
    unpinned, unpinned_prompt, unpinned_prefix = conversation(tokenizer, seed=5)
    unpinned["system"] = [{"type": "text", "text": unpinned["system"][0]["text"]}]
    unpinned["messages"] = [{"role": "user", "content": unpinned["messages"][0]["content"][0]["text"]}]
    assert split(claude.messages.create(**pinned).usage)[0] == full_blocks(prefix)
    assert split(claude.messages.create(**unpinned).usage)[0] == 0
    assert split(claude.messages.create(**unpinned).usage)[1] == full_blocks(unpinned_prefix)   # cached for now
    # Filler prompts of about two thirds of the unpinned blocks each, none sharing a block: three of them cycle
    # every block that is not held through the LRU queue (a word is a token or two; the template adds ~20).
    room = gauge(server, "kv_cache_total_blocks") - gauge(server, "kv_cache_pinned_blocks")
    filler_words = int(room * BLOCK_SIZE * 2 / 3 / 1.5) - 40
    rng = random.Random(6)
    for _ in range(3):
        text = unique_prompt(rng, filler_words)
        filled = claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}])
        assert filled.usage.cache_read_input_tokens == 0
    assert gauge(server, "kv_cache_pinned_blocks") >= full_blocks(prefix) // BLOCK_SIZE
    evicted = claude.messages.create(**unpinned)
    assert split(evicted.usage) == (0, 0, unpinned_prompt)
    hits_before = gauge(server, "prefix_cache_hits_total")
    survived = claude.messages.create(**pinned)
    assert split(survived.usage) == (0, full_blocks(prefix), prompt - full_blocks(prefix))
    assert gauge(server, "prefix_cache_hits_total") - hits_before == full_blocks(prefix)


@pytest.mark.parametrize("place", ["system", "message", "tool", "top"])
@pytest.mark.parametrize("control, named", [({"type": "persistent"}, "cache_control.type"),
                                            ({"type": "ephemeral", "ttl": "10m"}, "cache_control.ttl"),
                                            ({"ttl": "5m"}, "cache_control.type"),
                                            ({"type": "ephemeral", "scope": "x"}, "cache_control.scope")])
def test_bad_cache_control_values_are_400s_naming_the_field(server, place, control, named):
    body = {"model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "tools": [{"name": "noop", "input_schema": {"type": "object"}}]}
    target = {"system": body["system"][0], "message": body["messages"][0]["content"][0], "tool": body["tools"][0],
              "top": body}[place]
    target["cache_control"] = control
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"], error


def test_more_than_four_breakpoints_or_a_1h_after_a_5m_are_400s(server):
    def text(ttl: str | None = None) -> dict:
        return {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}}

    url = f"{server.url}/v1/messages"
    five = {"model": MODEL, "max_tokens": 2, "system": [text(), text()],
            "messages": [{"role": "user", "content": [text(), text(), text()]}]}
    response = httpx.post(url, json=five, timeout=TIMEOUT)
    assert response.status_code == 400 and "maximum of 4 blocks with cache_control" in response.text
    counted = httpx.post(f"{url}/count_tokens", json={k: v for k, v in five.items() if k != "max_tokens"},
                         timeout=TIMEOUT)
    assert counted.status_code == 400 and "Found 5" in counted.text
    late_hour = {"model": MODEL, "max_tokens": 2, "system": [text("5m")], "messages": [
        {"role": "user", "content": [text("1h")]}]}
    response = httpx.post(url, json=late_hour, timeout=TIMEOUT)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0.cache_control" in response.json()["error"]["message"]
    four = {"model": MODEL, "max_tokens": 2, "system": [text("1h"), text()],
            "messages": [{"role": "user", "content": [text(), text()]}]}
    assert httpx.post(url, json=four, timeout=TIMEOUT).status_code == 200
