"""SIGTERM while a request streams: the server stops cleanly (exit code 0) and the client is not left hanging.

Its own server process, since the test ends it.
"""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from test_server import MODEL, SERVER_FLAGS

from pagedllm.bench.reliability.server import ServerProcess

SHUTDOWN_TIMEOUT = 1.0   # seconds the streaming request gets to finish before it is aborted


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("server") / "server.log", *SERVER_FLAGS,
                            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    yield process
    process.stop()


def test_sigterm_mid_stream_exits_cleanly_and_ends_the_stream(server):
    events: list[str] = []
    client_error: list[Exception] = []
    first_event = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                        first_event.set()
        except httpx.HTTPError as exc:
            client_error.append(exc)
        finally:
            first_event.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first_event.wait(timeout=60) and events, "the stream never started"
    sent_at = time.monotonic()
    server.process.send_signal(signal.SIGTERM)

    assert server.process.wait(timeout=SHUTDOWN_TIMEOUT + 15) == 0, server.log()
    assert time.monotonic() - sent_at < SHUTDOWN_TIMEOUT + 15
    client.join(timeout=10)
    assert not client.is_alive(), "the client hangs"
    assert client_error or events[-1] == "data: [DONE]"   # an error, or a complete answer
    assert "Application shutdown complete" in server.log()
    with pytest.raises(httpx.ConnectError):   # nothing listens any more
        httpx.get(f"{server.url}/health")
