"""Servers shared by the reliability tests: the suite's own configurations, at its --quick sizes."""
from __future__ import annotations

import logging

import pytest

from benchmarks.reliability.fault_markers import FAULT_INJECTION_LAUNCHER
from benchmarks.reliability.suite import MAIN_SERVER_FLAGS, QUICK, STORM_SERVER_FLAGS
from pagedllm.bench.server_process import ServerProcess


@pytest.fixture(scope="session", autouse=True)
def quiet_httpx():
    logging.getLogger("httpx").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def main_server(tmp_path_factory):
    """The suite's main server: fault-injection hooks, an API key, a small KV cache so blocks get reused."""
    server = ServerProcess(tmp_path_factory.mktemp("main") / "server.log", "--kv-cache-memory",
                           QUICK.kv_cache_memory, *MAIN_SERVER_FLAGS, api_key="reliability-key",
                           launcher=FAULT_INJECTION_LAUNCHER)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def storm_server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("storm") / "server.log", *STORM_SERVER_FLAGS)
    yield server
    server.stop()
