"""SIGTERM while a request streams: the server stops cleanly (exit code 0) once its shutdown timeout has
passed, cancelling the request, and the client is not left hanging.

Its own server process, since the test ends it: the fault-injection launcher, whose hold keeps the request
part-way through its prefill, so it cannot finish by itself however fast the machine is.
"""
from __future__ import annotations

import json
import random
import signal
import threading

import httpx
import pytest

from benchmarks.reliability import faults
from benchmarks.reliability.fault_markers import HOLD_FAULT, HOLD_TIMEOUT
from pagedllm.bench.server_process import poll

MODEL = "smollm2"
SHUTDOWN_TIMEOUT = 1.0   # seconds the streaming request gets to finish before it is cancelled
# A step budget of 64 tokens and a prompt of several hundred: the launcher can hold the prefill part-way.
SERVER_FLAGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--max-num-batched-tokens", "64",
                "--served-model-name", MODEL, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
SERVER_FAULT_INJECTION = True
EXIT_GUARD = HOLD_TIMEOUT + 60   # seconds: a server that never exits fails the test instead of hanging it


def test_sigterm_mid_request_cancels_it_and_exits_cleanly(server):
    events: list[str] = []
    client_error: list[Exception] = []
    prompt = faults.unique_prompt(random.Random(3), 300)
    body = {"model": MODEL, "prompt": f"{prompt} {HOLD_FAULT}", "max_tokens": 16, "ignore_eos": True, "stream": True}

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=EXIT_GUARD) as response:
                events.extend(line for line in response.iter_lines() if line.startswith("data:"))
        except httpx.HTTPError as exc:
            client_error.append(exc)

    client = threading.Thread(target=stream)
    client.start()
    held = poll(lambda: faults.hold_counts(server)["held"], bool, EXIT_GUARD)
    assert held, "the launcher never held the request"
    server.process.send_signal(signal.SIGTERM)

    assert server.process.wait(timeout=EXIT_GUARD) == 0, server.log()
    client.join(timeout=EXIT_GUARD)
    assert not client.is_alive(), "the client hangs"
    # Held, the request could not finish: had the server waited for it past the shutdown timeout, the hold
    # would have ended at HOLD_TIMEOUT and the stream with its 16 tokens and [DONE].
    reasons = [choice["finish_reason"] for event in events if event != "data: [DONE]"
               for choice in json.loads(event.removeprefix("data:"))["choices"]]
    assert "length" not in reasons, events
    assert "Application shutdown complete" in server.log()
    with pytest.raises(httpx.ConnectError):   # nothing listens any more
        httpx.get(f"{server.url}/health")
