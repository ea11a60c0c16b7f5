"""Every fault scenario of the suite, each against its own kind of server: passes only if nothing hangs,
crashes, leaks a KV block or loses a request, and the server answers the next request."""
from __future__ import annotations

import random

import pytest

from benchmarks.reliability import faults
from benchmarks.reliability.suite import MODEL, QUICK, SIGTERM_SERVER_FLAGS

CLIENT_FAULTS = (faults.disconnect_mid_stream, faults.disconnect_before_first_token,
                 faults.disconnect_during_prefill)
ENGINE_FAULTS = (faults.injected_request_fault, faults.injected_step_fault)


@pytest.mark.parametrize("scenario", CLIENT_FAULTS + ENGINE_FAULTS, ids=lambda scenario: scenario.__name__)
def test_fault_leaves_the_server_whole(main_server, scenario):
    result = scenario(main_server, MODEL)
    assert result.passed, result.detail


def test_preemption_storm_loses_nothing(storm_server):
    result = faults.preemption_storm(storm_server, MODEL, QUICK.storm_requests)
    assert result.passed, result.detail


def test_sigterm_under_load(tmp_path):
    result = faults.sigterm_under_load(tmp_path / "server.log", SIGTERM_SERVER_FLAGS, MODEL, QUICK.sigterm_clients)
    assert result.passed, result.detail


def test_recovery_check_sees_a_request_still_holding_blocks(main_server, monkeypatch):
    """The check every scenario ends with can fail: a request the launcher holds mid-prefill, its client
    still connected, is reported as held blocks (however long the check waits)."""
    monkeypatch.setattr(faults, "RECOVERY_TIMEOUT", 1.0)
    with faults.held_prefill(main_server, MODEL, faults.unique_prompt(random.Random(1), faults.PREFILL_WORDS)) as held:
        assert held
        problems = faults.idle_problems(main_server)
    assert any("not idle" in problem for problem in problems), problems
