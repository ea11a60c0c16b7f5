"""`pagedllm bench serving`: load a running OpenAI-compatible server and time every token.

Open loop (`--request-rate R`: Poisson arrivals, R requests/s) or closed loop
(`--max-concurrency C`: C clients back to back). Each request streams a completion of
exactly its max_tokens (ignore_eos); reported: time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL), end-to-end latency,
p50/p90/p99, and throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from pagedllm.bench.scheduling import percentile
from pagedllm.bench.workload import BenchRequest, add_workload_arguments, workload_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    add_workload_arguments(parser)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=None, help="open loop: requests per second")
    load.add_argument("--max-concurrency", type=int, default=None, help="closed loop: clients at once")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for one request")


@dataclass
class RequestTiming:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)   # seconds since the request was sent
    latency: float = 0.0


async def _one_request(client, url: str, headers: dict, model: str, item: BenchRequest) -> RequestTiming:
    timing = RequestTiming(prompt_tokens=len(item.prompt_token_ids))
    body = {"model": model, "prompt": item.prompt_token_ids, "max_tokens": item.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    timing.token_times.append(time.perf_counter() - started)
        timing.latency = time.perf_counter() - started
        timing.ok = True
    except Exception as exc:   # a failed request is counted, not fatal to the benchmark
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def _run_load(args: argparse.Namespace, workload: list[BenchRequest]) -> tuple[list[RequestTiming], float]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or len(workload))
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        bar = tqdm(total=len(workload), desc="requests")
        gate = asyncio.Semaphore(args.max_concurrency or len(workload))
        rng = random.Random(args.seed)

        async def send(item: BenchRequest, delay: float) -> RequestTiming:
            await asyncio.sleep(delay)
            async with gate:
                timing = await _one_request(client, "/v1/completions", headers, model, item)
            bar.update(1)
            return timing

        delays, clock = [], 0.0
        for _ in workload:
            delays.append(clock)
            if args.request_rate:
                clock += rng.expovariate(args.request_rate)
        started = time.perf_counter()
        timings = await asyncio.gather(*(send(item, delay) for item, delay in zip(workload, delays)))
        elapsed = time.perf_counter() - started
        bar.close()
    return timings, elapsed


def run(args: argparse.Namespace) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)   # not one log line per request
    workload = workload_from_args(args)
    timings, elapsed = asyncio.run(_run_load(args, workload))
    done = [t for t in timings if t.ok]
    errors = [t for t in timings if not t.ok]
    ttft = [t.token_times[0] for t in done if t.token_times]
    tpot = [(t.latency - t.token_times[0]) / (t.output_tokens - 1) for t in done
            if t.token_times and t.output_tokens > 1]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    e2e = [t.latency for t in done]
    output_tokens = sum(t.output_tokens for t in done)
    mode = (f"open loop at {args.request_rate} req/s" if args.request_rate else
            f"closed loop, {args.max_concurrency} clients" if args.max_concurrency else "all at once")
    print(f"{len(workload)} requests ({mode}): {len(done)} completed, {len(errors)} errors, {elapsed:.1f} s")
    for error in errors[:3]:
        print(f"  error: {error.error}")
    print(f"throughput: {len(done) / elapsed:.2f} req/s, {output_tokens / elapsed:.1f} output tok/s, "
          f"{(output_tokens + sum(t.prompt_tokens for t in done)) / elapsed:.1f} total tok/s")
    print("| ms | mean | p50 | p90 | p99 |")
    print("|---|---|---|---|---|")
    for name, values in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2E latency", e2e)):
        if values:
            print(f"| {name} | {statistics.fmean(values) * 1e3:.1f} | {percentile(values, 0.5) * 1e3:.1f} "
                  f"| {percentile(values, 0.9) * 1e3:.1f} | {percentile(values, 0.99) * 1e3:.1f} |")
