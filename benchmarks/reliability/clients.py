"""The suite's clients: mixed chat and completion requests sent with the official openai client.

Each request is recorded, never raised: the suite counts errors instead of stopping at the first.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx
import openai

TOPICS = ("Explain how a hash map works", "Write a haiku about the sea", "List three uses of copper",
          "Why is the sky blue?", "Describe a cat to someone who has never seen one",
          "Summarise the rules of chess", "What makes bread rise?", "Give advice to a new programmer")
FILLER = ("Please answer carefully, in plain words, and keep to the point; the reader is busy and curious. ")


@dataclass(frozen=True)
class RequestSpec:
    kind: str            # "chat" or "completion"
    prompt: str
    max_tokens: int
    stream: bool = True
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class RequestRecord:
    spec: RequestSpec
    ok: bool = False
    error: str = ""
    ttft: float | None = None        # seconds from sending to the first text
    latency: float = 0.0
    output_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""


def mixed_requests(count: int, seed: int, max_tokens: tuple[int, int] = (8, 96), max_filler: int = 8,
                   streaming_fraction: float = 1.0) -> list[RequestSpec]:
    """Chat and completion requests of mixed prompt and output lengths, greedy and sampled, reproducibly."""
    rng = random.Random(seed)
    specs = []
    for index in range(count):
        prompt = rng.choice(TOPICS) + ". " + FILLER * rng.randint(0, max_filler)
        sampled = rng.random() < 0.5
        specs.append(RequestSpec(kind=("chat", "completion")[index % 2], prompt=prompt,
                                 max_tokens=rng.randint(*max_tokens), stream=rng.random() < streaming_fraction,
                                 temperature=0.8 if sampled else 0.0, ignore_eos=rng.random() < 0.5,
                                 seed=rng.randrange(2**31) if sampled else None))
    return specs


def async_client(base_url: str, api_key: str | None, timeout: float, max_connections: int) -> openai.AsyncOpenAI:
    """One client for many concurrent requests: enough connections that none waits for a free one."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key or "none", max_retries=0, timeout=timeout,
                              http_client=httpx.AsyncClient(limits=limits, timeout=timeout))


async def send(client: openai.AsyncOpenAI, model: str, spec: RequestSpec,
               first_text: asyncio.Event | None = None) -> RequestRecord:
    """Sends one request and records how it went; a request only counts as ok with a finish reason.

    first_text, if given, is set when the first text arrives, or when the request ends without any, so
    that whoever waits for it knows the request got that far and never waits for one that is over.
    """
    try:
        return await _send(client, model, spec, first_text)
    finally:
        if first_text is not None:
            first_text.set()


async def _send(client: openai.AsyncOpenAI, model: str, spec: RequestSpec,
                first_text: asyncio.Event | None) -> RequestRecord:
    record = RequestRecord(spec)
    common = {"model": model, "max_tokens": spec.max_tokens, "temperature": spec.temperature, "seed": spec.seed,
              "extra_body": {"ignore_eos": spec.ignore_eos}}
    if spec.stream:
        common["stream"], common["stream_options"] = True, {"include_usage": True}
    started = time.perf_counter()
    try:
        if spec.kind == "chat":
            response = await client.chat.completions.create(
                messages=[{"role": "user", "content": spec.prompt}], **common)
        else:
            response = await client.completions.create(prompt=spec.prompt, **common)
        if spec.stream:
            async for chunk in response:
                _add_chunk(record, chunk, started)
                if first_text is not None and record.ttft is not None:
                    first_text.set()
        else:
            choice = response.choices[0]
            record.text = choice.message.content if spec.kind == "chat" else choice.text
            record.finish_reason = choice.finish_reason
            record.output_tokens = response.usage.completion_tokens
            record.ttft = time.perf_counter() - started
        record.ok = record.finish_reason in ("stop", "length")
        if not record.ok:
            record.error = f"no finish reason (got {record.finish_reason!r})"
    except (openai.OpenAIError, httpx.HTTPError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.latency = time.perf_counter() - started
    return record


def _add_chunk(record: RequestRecord, chunk, started: float) -> None:
    if chunk.usage is not None:
        record.output_tokens = chunk.usage.completion_tokens
    for choice in chunk.choices:
        text = choice.delta.content if record.spec.kind == "chat" else choice.text
        if text:
            if record.ttft is None:
                record.ttft = time.perf_counter() - started
            record.text += text
        if choice.finish_reason is not None:
            record.finish_reason = choice.finish_reason
