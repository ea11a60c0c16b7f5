"""Load: N concurrent clients stream mixed chat and completion requests, bounded in count and time."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from benchmarks.reliability.clients import RequestRecord, RequestSpec, async_client, mixed_requests, send
from pagedllm.bench.scheduling import percentile
from pagedllm.bench.server_process import EngineFigures, ServerProcess

METRICS_INTERVAL = 0.2   # seconds between /metrics scrapes while the load runs


@dataclass
class LoadResult:
    clients: int
    requests: int
    completed: int
    errors: list[str]
    ttft_p50: float
    ttft_p99: float
    output_tokens_per_s: float
    wall_seconds: float
    peak_running: int
    peak_waiting: int
    preemptions: int
    pool_whole_after: bool


@dataclass
class EnginePeaks:
    running: float = 0
    waiting: float = 0


async def watch_engine(server: ServerProcess, peaks: EnginePeaks, stop: asyncio.Event) -> None:
    """Scrapes /metrics until stopped, keeping the highest running and waiting counts seen."""
    async with httpx.AsyncClient(headers=server.headers, timeout=30) as http:
        while not stop.is_set():
            figures = EngineFigures((await http.get(f"{server.url}/metrics")).text)
            peaks.running = max(peaks.running, figures.running)
            peaks.waiting = max(peaks.waiting, figures.waiting)
            try:
                await asyncio.wait_for(stop.wait(), METRICS_INTERVAL)
            except asyncio.TimeoutError:
                pass


async def run_clients(server: ServerProcess, model: str, specs: list[RequestSpec], clients: int,
                      time_limit: float, request_timeout: float) -> list[RequestRecord]:
    """`clients` workers take the next request as soon as their last one ends, until the specs run out or
    time_limit passes (requests already sent still finish)."""
    client = async_client(server.url, server.api_key, request_timeout, max_connections=clients)
    pending = iter(specs)
    deadline = time.monotonic() + time_limit
    records: list[RequestRecord] = []

    async def worker() -> None:
        for spec in pending:
            records.append(await send(client, model, spec))
            if time.monotonic() > deadline:
                return

    async with client:
        await asyncio.gather(*(worker() for _ in range(clients)))
    return records


def run_load(server: ServerProcess, model: str, clients: int, requests: int, seed: int = 0,
             time_limit: float = 600.0, request_timeout: float = 300.0) -> LoadResult:
    specs = mixed_requests(requests, seed)
    before = server.wait_until_idle()

    async def main() -> tuple[list[RequestRecord], EnginePeaks, float]:
        peaks, stop = EnginePeaks(), asyncio.Event()
        watcher = asyncio.create_task(watch_engine(server, peaks, stop))
        started = time.perf_counter()
        records = await run_clients(server, model, specs, clients, time_limit, request_timeout)
        elapsed = time.perf_counter() - started
        stop.set()
        await watcher
        return records, peaks, elapsed

    records, peaks, elapsed = asyncio.run(main())
    after = server.wait_until_idle()
    done = [record for record in records if record.ok]
    ttfts = [record.ttft for record in done if record.ttft is not None]
    return LoadResult(
        clients=clients, requests=len(records), completed=len(done),
        errors=[record.error for record in records if not record.ok],
        ttft_p50=percentile(ttfts, 0.5) if ttfts else float("nan"),
        ttft_p99=percentile(ttfts, 0.99) if ttfts else float("nan"),
        output_tokens_per_s=sum(record.output_tokens for record in done) / elapsed, wall_seconds=elapsed,
        peak_running=int(peaks.running), peak_waiting=int(peaks.waiting),
        preemptions=int(after.preemptions - before.preemptions), pool_whole_after=after.idle)
