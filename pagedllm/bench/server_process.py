"""A `pagedllm serve` subprocess on a free loopback port, and what benchmarks and tests read from it.

The reliability suite, the server benchmarks and the tests drive servers through this one class, so a
server is started, probed (health, /metrics, RSS) and stopped the same way everywhere.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

SERVE_MODULE = "pagedllm.entrypoints.cli"
STARTUP_TIMEOUT = 180   # seconds: loading the model on a busy 2-core machine
POLL_INTERVAL = 0.1     # seconds between two looks at a server's state
T = TypeVar("T")


class ServerProcess:
    """`pagedllm serve` with the given flags, its output in log_path.

    launcher: the module run as `python -m LAUNCHER serve ...`; the reliability suite's fault-injection
    launcher (benchmarks/reliability/fault_injection.py) is found where this process finds it, even when
    that is a source tree outside the installed package.
    """

    def __init__(self, log_path: Path, *flags: str, api_key: str | None = None, launcher: str = SERVE_MODULE,
                 startup_timeout: float = STARTUP_TIMEOUT):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        command = [sys.executable, "-m", launcher, "serve", "--port", str(self.port), *flags]
        if api_key is not None:
            command += ["--api-key", api_key]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_env_finding(launcher))
        self._wait_until_healthy(startup_timeout)

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def _wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def openai_client(self, timeout: float = 120.0) -> openai.OpenAI:
        """The official client, never retrying: the suite counts every failure."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        return psutil.Process(self.process.pid).memory_info().rss

    def metrics_text(self) -> str:
        response = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=30)
        response.raise_for_status()
        return response.text

    def engine_figures(self) -> EngineFigures:
        return EngineFigures(self.metrics_text())

    def wait_until_idle(self, timeout: float = 30.0) -> EngineFigures:
        """Polls /metrics until nothing runs or waits and every KV block is free; returns the last figures
        (the caller checks them: after the timeout they may still show a busy engine)."""
        return poll(self.engine_figures, lambda figures: figures.idle, timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after timeout seconds; returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


class EngineFigures:
    """The engine's gauges and counters from one /metrics scrape."""

    def __init__(self, text: str):
        self.text = text
        self.running = metric(text, "pagedllm:num_requests_running")
        self.waiting = metric(text, "pagedllm:num_requests_waiting")
        self.kv_usage = metric(text, "pagedllm:kv_cache_usage_perc")
        self.total_blocks = metric(text, "pagedllm:kv_cache_total_blocks")
        self.free_blocks = metric(text, "pagedllm:kv_cache_free_blocks")
        self.preemptions = metric(text, "pagedllm:num_preemptions_total")

    @property
    def pool_whole(self) -> bool:
        """Every KV block is back in the pool (idle prefix-cache blocks count: they are reusable)."""
        return self.total_blocks > 0 and self.free_blocks == self.total_blocks

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.pool_whole


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0 if absent, as a counter not yet touched)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def poll(read: Callable[[], T], done: Callable[[T], bool], timeout: float) -> T:
    """Calls read() until done(its value) or timeout seconds have passed; returns the last value (the
    caller checks it). The way to wait for a state without guessing how long the server takes."""
    deadline = time.monotonic() + timeout
    while not done(value := read()) and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL)
    return value


def _env_finding(module: str) -> dict[str, str]:
    """This environment, with PYTHONPATH led by the folder this process imports module's top package from."""
    spec = importlib.util.find_spec(module.partition(".")[0])
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"launcher must be an importable module of a package, got {module!r}")
    root = str(Path(next(iter(spec.submodule_search_locations))).parent)
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
