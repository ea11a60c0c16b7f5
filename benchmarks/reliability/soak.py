"""Soak: thousands of short requests back to back, in waves, with the KV pool checked at every idle point
between waves and the server's RSS sampled throughout. A fixed greedy probe is asked at the start and at
the end: a server that leaks or corrupts state shows it as growth, a partial pool or a changed answer.

The first quarter is warm-up: every new batch shape JITs and caches its oneDNN kernels, and glibc raises its
mmap threshold as large tensors are freed, so RSS climbs a few percent over the first few hundred requests and
then stays flat (measured: 835 -> 865 MiB over 500 requests, then 850-874 MiB up to 1,500). Growth is therefore
the last quarter's mean over the second's; a steady leak still shows as half its whole growth."""
from __future__ import annotations

import asyncio
import statistics
import threading
import time
from dataclasses import dataclass

from benchmarks.reliability.clients import mixed_requests
from benchmarks.reliability.load import run_clients
from pagedllm.bench.server_process import ServerProcess

RSS_INTERVAL = 0.25   # seconds between RSS samples
PROBE = "In one sentence: why do computers use binary?"


@dataclass
class SoakResult:
    requests: int
    completed: int
    errors: list[str]
    idle_points: int
    idle_points_whole: int       # idle points where every KV block was free and nothing ran or waited
    rss_second_quarter_mib: float
    rss_last_quarter_mib: float
    rss_growth: float            # last quarter's mean RSS over the second's, minus 1
    probe_start: str
    probe_end: str
    wall_seconds: float

    @property
    def probe_same(self) -> bool:
        return self.probe_start == self.probe_end


class RSSSampler:
    """Samples a process's RSS on a thread, so the samples keep coming while the event loop is busy."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.server.rss_bytes()))
            self._stop.wait(RSS_INTERVAL)

    def warm_and_last_quarter_means(self) -> tuple[float, float]:
        """Mean RSS over the second (the first after warm-up) and the last quarter of the sampled time."""
        start, end = self.samples[0][0], self.samples[-1][0]
        quarter = (end - start) / 4
        warm = [rss for at, rss in self.samples if start + quarter <= at <= start + 2 * quarter]
        last = [rss for at, rss in self.samples if at >= end - quarter]
        return statistics.fmean(warm), statistics.fmean(last)


def ask_probe(server: ServerProcess, model: str) -> str:
    response = server.openai_client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROBE}], max_tokens=32, temperature=0)
    return response.choices[0].message.content


def run_soak(server: ServerProcess, model: str, requests: int, wave_size: int = 100, concurrency: int = 32,
             seed: int = 1, request_timeout: float = 300.0) -> SoakResult:
    specs = mixed_requests(requests, seed, max_tokens=(1, 16), max_filler=4, streaming_fraction=0.5)
    server.wait_until_idle()
    probe_start = ask_probe(server, model)
    records, idle_points_whole, idle_points = [], 0, 0
    started = time.perf_counter()
    with RSSSampler(server) as rss:
        for wave_start in range(0, len(specs), wave_size):
            wave = specs[wave_start:wave_start + wave_size]
            records += asyncio.run(run_clients(server, model, wave, concurrency, float("inf"), request_timeout))
            idle_points += 1
            idle_points_whole += server.wait_until_idle().idle
    elapsed = time.perf_counter() - started
    warm, last = rss.warm_and_last_quarter_means()
    return SoakResult(
        requests=len(records), completed=sum(record.ok for record in records),
        errors=[record.error for record in records if not record.ok], idle_points=idle_points,
        idle_points_whole=idle_points_whole, rss_second_quarter_mib=warm / 2**20, rss_last_quarter_mib=last / 2**20,
        rss_growth=last / warm - 1, probe_start=probe_start, probe_end=ask_probe(server, model),
        wall_seconds=elapsed)
