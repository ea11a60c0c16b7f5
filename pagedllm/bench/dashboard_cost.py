"""`pagedllm bench dashboard`: server throughput on a workload with the dashboard's feed open and closed.

One `pagedllm serve` process runs the workload (as `bench serving` sends it, all at once) several
times, alternating a closed page and an open one, so slow drift of the machine falls on both alike; the
drop is given as the mean's and as the median of each round's (its open run against its closed run).
"Open" is a reader of /v1/kv_map/events in another process that parses every frame as the page does:
the server's side of an open page (a browser drawing on this machine would compete for its cores,
which is a cost of the client, not of the server).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import statistics
import tempfile
from pathlib import Path

from pagedllm.bench import serving
from pagedllm.bench.workload import add_workload_arguments, workload_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--rounds", type=int, default=2, help="closed/open pairs, alternating (default: 2)")
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--max-model-len", type=int, default=1024)


def read_feed(url: str, frames, subscribed) -> None:
    """Reads the dashboard's Server-Sent Events and parses each frame, until terminated."""
    import httpx

    with httpx.Client(timeout=None) as client, client.stream("GET", f"{url}/v1/kv_map/events") as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                frames.value += 1
                subscribed.set()


def run(args: argparse.Namespace) -> None:
    from pagedllm.bench.server_process import ServerProcess

    logging.getLogger("httpx").setLevel(logging.WARNING)
    workload = workload_from_args(args)
    log = Path(tempfile.mkdtemp(prefix="pagedllm-dashboard-cost-")) / "server.log"
    server = ServerProcess(log, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len))
    load_args = argparse.Namespace(base_url=server.url, api_key=None, model=None, max_concurrency=None,
                                   request_rate=None, seed=args.seed, timeout=600.0)
    results: dict[str, list[float]] = {"closed": [], "open": []}
    try:
        # A first run warms the server (allocator, kernel caches, a cold prefix cache): measured at about
        # half the later runs' rate here, it would count against whichever mode came first.
        timings, elapsed = asyncio.run(serving._run_load(load_args, workload))
        print(f"warm-up (not counted): {sum(timing.output_tokens for timing in timings) / elapsed:.1f} output tok/s")
        for round_index in range(args.rounds):
            for mode in ("closed", "open") if round_index % 2 == 0 else ("open", "closed"):
                frames, subscribed = multiprocessing.Value("i", 0), multiprocessing.Event()
                reader = None
                if mode == "open":   # the load starts once the feed has sent its first frame
                    reader = multiprocessing.Process(target=read_feed, args=(server.url, frames, subscribed))
                    reader.start()
                    if not subscribed.wait(60):
                        raise RuntimeError(f"no dashboard frame within 60 s; server log: {log}")
                    frames.value = 0
                timings, elapsed = asyncio.run(serving._run_load(load_args, workload))
                if reader is not None:
                    reader.terminate()
                    reader.join()
                failed = sum(not timing.ok for timing in timings)
                rate = sum(timing.output_tokens for timing in timings) / elapsed
                results[mode].append(rate)
                print(f"round {round_index + 1}, page {mode}: {rate:.1f} output tok/s, {elapsed:.1f} s, "
                      f"{failed} failed" + (f", {frames.value} frames read during it ({frames.value / elapsed:.1f}/s)"
                                            if reader is not None else ""))
    finally:
        server.stop()
    closed, opened = statistics.fmean(results["closed"]), statistics.fmean(results["open"])
    # Each round's drop from its own closed run: drift between rounds cancels within a pair.
    drops = [1 - open_rate / closed_rate for closed_rate, open_rate in zip(results["closed"], results["open"])]
    print(f"{len(workload)} requests per run; mean output tok/s: page closed {closed:.1f}, page open {opened:.1f}: "
          f"{(1 - opened / closed):+.1%} drop; median of the rounds' drops {statistics.median(drops):+.1%} "
          f"(min {min(drops):+.1%}, max {max(drops):+.1%})")
