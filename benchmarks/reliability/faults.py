"""Faults: clients that leave at the worst moments, requests that fail inside the engine, KV exhaustion
forcing preemption storms, SIGTERM under load. After each the server must answer the next request and
hold no KV block; a scenario that hangs, crashes, leaks or loses a request does not pass."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from benchmarks.reliability.clients import RequestSpec, async_client, send
from benchmarks.reliability.fault_markers import HOLD_FAULT, HOLDS_ROUTE, REQUEST_FAULT, STEP_FAULT
from pagedllm.bench.server_process import ServerProcess, metric, poll

RECOVERY_TIMEOUT = 30.0   # seconds the server gets to free everything after a fault
CLIENT_TIMEOUT = 120.0    # a request still open after this long counts as hanging
PREFILL_WORDS = 600       # a prompt of about as many tokens: more than one step's budget on the suite's main server


@dataclass
class FaultResult:
    name: str
    passed: bool
    detail: str


def idle_problems(server: ServerProcess) -> list[str]:
    """A KV block still held or a request still running or queued, RECOVERY_TIMEOUT after a fault."""
    figures = server.wait_until_idle(RECOVERY_TIMEOUT)
    return [] if figures.idle else [
        f"not idle after {RECOVERY_TIMEOUT:.0f} s: {figures.free_blocks:.0f}/{figures.total_blocks:.0f} blocks "
        f"free, {figures.running:.0f} running, {figures.waiting:.0f} waiting"]


def recovery_problems(server: ServerProcess, model: str) -> list[str]:
    """What is wrong after a fault: a KV block still held, a request still queued, no answer to the next one."""
    problems = idle_problems(server)
    try:
        server.openai_client(CLIENT_TIMEOUT).completions.create(model=model, prompt="Hello", max_tokens=2)
    except openai.OpenAIError as exc:
        problems.append(f"the next request failed: {exc}")
    return problems


def _result(name: str, server: ServerProcess, model: str, problems: list[str], detail: str) -> FaultResult:
    problems = problems + recovery_problems(server, model)
    return FaultResult(name, not problems, "; ".join(problems) if problems else detail)


def _stream_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


WORDS = ("apple", "river", "stone", "light", "green", "house", "music", "paper", "cloud", "table", "water", "night")


def unique_prompt(rng: random.Random, num_words: int) -> str:
    """About num_words tokens that no other prompt shares a first block with, so the prefix cache cannot
    shorten their prefill."""
    return " ".join([str(rng.randrange(10**12)), *(rng.choice(WORDS) for _ in range(num_words))])


def disconnect_mid_stream(server: ServerProcess, model: str, clients: int = 8, events: int = 3) -> FaultResult:
    """Streaming clients read a few events and leave; their requests (long, ignore_eos) must be aborted."""

    async def leave_after_events(http: httpx.AsyncClient, index: int) -> int:
        seen = 0
        body = _stream_body(model, f"Story number {index}:", 1000)
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen == events:
                    break
        return seen

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=CLIENT_TIMEOUT) as http:
            return await asyncio.gather(*(leave_after_events(http, index) for index in range(clients)))

    ran_to_the_end = functools.partial(_finished_by_length, server)
    before = ran_to_the_end()
    seen = asyncio.run(main())
    problems = [f"only {sum(s == events for s in seen)}/{clients} streams started"] if min(seen) < events else []
    problems += idle_problems(server)   # every request has ended: aborted, or (wrongly) run to its end
    finished = ran_to_the_end() - before
    if finished:
        problems.append(f"{finished:.0f}/{clients} requests ran to max_tokens after their client left")
    return _result("disconnect mid-stream", server, model, problems,
                   f"{clients} streams of 1000 tokens left after {events} events, all aborted")


def _finished_by_length(server: ServerProcess) -> float:
    """Requests the server has answered to their max_tokens so far."""
    return metric(server.metrics_text(), "pagedllm:request_success_total", finished_reason="length")


def disconnect_before_first_token(server: ServerProcess, model: str, clients: int = 16) -> FaultResult:
    """While the launcher holds the engine part-way through another prefill (no step runs, so no answer can
    exist), raw connections send a whole request and close at once: each that reaches the engine must leave
    its queue, aborted, before the hold ends."""

    async def send_and_close(index: int) -> None:
        body = (f'{{"model": "{model}", "prompt": "Count to a thousand, take {index}:", "max_tokens": 1000, '
                f'"ignore_eos": true, "stream": {str(index % 2 == 0).lower()}}}').encode()
        headers = "".join(f"{name}: {value}\r\n" for name, value in server.headers.items())
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + headers.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def main() -> None:
        await asyncio.gather(*(send_and_close(index) for index in range(clients)))

    arrived_before = hold_counts(server)["arrived"]
    with held_prefill(server, model, unique_prompt(random.Random(2), PREFILL_WORDS)) as held:
        problems = [] if held else ["the launcher never held the engine"]
        if held:
            asyncio.run(main())
            arrived = poll(lambda: hold_counts(server)["arrived"] - arrived_before, lambda n: n == clients,
                           RECOVERY_TIMEOUT)
            waiting = poll(server.engine_figures, lambda figures: figures.waiting == 0, RECOVERY_TIMEOUT).waiting
            if waiting:
                problems.append(f"{waiting:.0f} requests whose client left still wait in the held engine")
    return _result("disconnect before first token", server, model, problems,
                   f"{clients} connections closed right after sending, while the engine was held: "
                   f"{arrived if held else 0} reached it and were aborted before any step (a client may close "
                   "before its request leaves the HTTP layer, which then drops it)")


def hold_counts(server: ServerProcess) -> dict[str, int]:
    """The fault-injection launcher's hold counts (see fault_injection.Holds)."""
    response = httpx.get(f"{server.url}{HOLDS_ROUTE}", headers=server.headers, timeout=CLIENT_TIMEOUT)
    response.raise_for_status()
    return response.json()


@contextlib.contextmanager
def held_prefill(server: ServerProcess, model: str, prompt: str) -> Iterator[bool]:
    """Streams a HOLD_FAULT request of prompt (longer than a step's token budget) and yields once the launcher
    holds the engine part-way through its prefill: True, or False if it never did. Leaving closes the
    connection, and returns once the hold has ended (by the request's abort, or its safety timeout)."""
    read_counts = functools.partial(hold_counts, server)
    before = read_counts()
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=server.headers, timeout=CLIENT_TIMEOUT,
                      json=_stream_body(model, f"{prompt} {HOLD_FAULT}", 1000)):
        yield bool(poll(read_counts, lambda counts: counts != before, CLIENT_TIMEOUT)["held"])
    poll(read_counts, lambda counts: not counts["held"], CLIENT_TIMEOUT)


def disconnect_during_prefill(server: ServerProcess, model: str, clients: int = 4,
                              prompt_words: int = PREFILL_WORDS) -> FaultResult:
    """Clients send long prompts and leave while the launcher holds the engine part-way through their
    prefill (fresh prompts each time, so the prefix cache does not shorten it): each hold must end by
    its request being aborted."""
    rng = random.Random(0)
    before, held = hold_counts(server), 0
    for _ in range(clients):
        with held_prefill(server, model, unique_prompt(rng, prompt_words)) as was_held:
            held += was_held
    after = hold_counts(server)
    left = after["left"] - before["left"]
    problems = [] if held == left == clients else [
        f"{held}/{clients} prefills held, {left} ended by their client leaving "
        f"({after['timed_out'] - before['timed_out']} timed out, {after['missed'] - before['missed']} missed)"]
    return _result("disconnect during prefill", server, model, problems,
                   f"{left}/{clients} clients left while the engine held their prefill part-way")


async def streaming(client: openai.AsyncOpenAI, model: str, specs: list[RequestSpec]) -> list[asyncio.Task]:
    """Sends streamed requests and returns their tasks once each has streamed its first text (or ended):
    a known point, past every prefill, however fast the machine is."""
    first_texts = [asyncio.Event() for _ in specs]
    tasks = [asyncio.create_task(send(client, model, spec, first_text))
             for spec, first_text in zip(specs, first_texts)]
    await asyncio.gather(*(first_text.wait() for first_text in first_texts))
    return tasks


async def _send_all(server: ServerProcess, model: str, specs: list[RequestSpec]) -> list:
    async with async_client(server.url, server.api_key, CLIENT_TIMEOUT, max_connections=len(specs)) as client:
        return await asyncio.gather(*(send(client, model, spec) for spec in specs))


def injected_request_fault(server: ServerProcess, model: str, bystanders: int = 6,
                           max_tokens: int = 24) -> FaultResult:
    """Requests that fail inside the engine's per-request path, streamed and not, among healthy ones: the
    marked ones get an error, every bystander its whole answer."""
    healthy = [RequestSpec("completion", f"Healthy request {i}:", max_tokens, stream=i % 2 == 0, ignore_eos=True)
               for i in range(bystanders)]
    faulty = [RequestSpec(kind, f"{REQUEST_FAULT} fail me", max_tokens, stream=stream, ignore_eos=True)
              for kind, stream in (("completion", True), ("chat", False))]
    records = asyncio.run(_send_all(server, model, healthy + faulty))
    bystander_records, faulty_records = records[:bystanders], records[bystanders:]
    problems = [f"bystander lost: {record.error or record.output_tokens}" for record in bystander_records
                if not (record.ok and record.output_tokens == max_tokens)]
    problems += ["a marked request succeeded" for record in faulty_records if record.ok]
    return _result("request fails in the engine", server, model, problems,
                   f"{len(faulty)} marked requests got errors "
                   f"({'; '.join(r.error.split(':')[0] for r in faulty_records)}); "
                   f"{bystanders} bystanders finished whole")


def injected_step_fault(server: ServerProcess, model: str, bystanders: int = 6) -> FaultResult:
    """A request that makes its whole model step raise: everything in flight ends with an error or an
    answer, none hangs, and the engine serves the requests that follow."""

    async def main() -> list:
        async with async_client(server.url, server.api_key, CLIENT_TIMEOUT, bystanders + 1) as client:
            healthy = await streaming(client, model, [RequestSpec("completion", f"In flight {i}:", 200,
                                                                  ignore_eos=True) for i in range(bystanders)])
            decoding = sum(not task.done() for task in healthy)
            faulty = send(client, model, RequestSpec("chat", f"{STEP_FAULT} fail the step", 8))
            return decoding, *await asyncio.gather(faulty, *healthy)

    started = time.perf_counter()
    decoding, faulty, *healthy = asyncio.run(main())
    elapsed = time.perf_counter() - started
    problems = ["the marked request succeeded"] if faulty.ok else []
    return _result("step fails in the engine", server, model, problems,
                   f"marked request, sent while {decoding}/{bystanders} bystanders were decoding, failed "
                   f"({faulty.error.split(':')[0]}); of the bystanders {sum(r.ok for r in healthy)} finished, "
                   f"{sum(not r.ok for r in healthy)} got errors; all ended in {elapsed:.1f} s")


def preemption_storm(server: ServerProcess, model: str, requests: int = 12, max_tokens: int = 48) -> FaultResult:
    """Far more concurrent greedy requests than the KV cache holds (give this server a small cache and
    float32): preemptions must happen, and every answer must equal the same request's answer alone."""
    specs = [RequestSpec("completion", f"Tell me about the number {i * 37}.", max_tokens, ignore_eos=True)
             for i in range(requests)]
    before = server.wait_until_idle()
    together = asyncio.run(_send_all(server, model, specs))
    preemptions = server.wait_until_idle().preemptions - before.preemptions
    alone = [asyncio.run(_send_all(server, model, [spec]))[0] for spec in specs]
    problems = [f"only {sum(r.ok for r in together)}/{requests} finished: "
                f"{next(r.error for r in together if not r.ok)}"] if not all(r.ok for r in together) else []
    if preemptions == 0:
        problems.append("no preemption happened: the cache was not exhausted")
    differ = sum(a.text != b.text for a, b in zip(together, alone))
    if differ:
        problems.append(f"{differ}/{requests} answers differ from the same request alone")
    return _result("KV exhaustion storm", server, model, problems,
                   f"{requests} requests x {max_tokens} tokens: {preemptions:.0f} preemptions, all answers "
                   f"equal to solo runs")


def sigterm_under_load(log_path: Path, flags: tuple[str, ...], model: str, clients: int = 32,
                       shutdown_timeout: float = 2.0) -> FaultResult:
    """SIGTERM while many clients stream: each gets its whole answer or an error, none hangs, and the
    process exits 0 within its shutdown timeout (plus start-up slack)."""
    server = ServerProcess(log_path, *flags, "--shutdown-timeout", str(shutdown_timeout))
    specs = [RequestSpec("chat" if i % 2 else "completion", f"Long story {i}:", 400, ignore_eos=True)
             for i in range(clients)]

    async def main() -> list:
        async with async_client(server.url, None, CLIENT_TIMEOUT, clients) as client:
            tasks = await streaming(client, model, specs)
            decoding = sum(not task.done() for task in tasks)
            sent_at = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            done, pending = await asyncio.wait(tasks, timeout=shutdown_timeout + 30)
            for task in pending:
                task.cancel()
            return decoding, [task.result() for task in done], len(pending), time.monotonic() - sent_at

    decoding, records, hanging, ended_after = asyncio.run(main())
    try:
        exit_code = server.process.wait(timeout=shutdown_timeout + 30)
    except subprocess.TimeoutExpired:
        exit_code = server.stop()
    problems = [f"{hanging} clients hang"] if hanging else []
    if exit_code != 0:
        problems.append(f"exit code {exit_code}")
    completed = sum(record.ok for record in records)
    detail = (f"{clients} streams, {decoding} of them decoding at SIGTERM: {completed} finished, "
              f"{len(records) - completed} got errors, all ended {ended_after:.1f} s after SIGTERM; "
              f"exit code {exit_code}")
    return FaultResult("SIGTERM under load", not problems, "; ".join(problems) if problems else detail)
