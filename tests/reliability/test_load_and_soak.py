"""The suite's load and soak phases at --quick sizes: no errors, the KV pool whole at every idle point,
no memory growth, the same greedy answer before and after."""
from __future__ import annotations

from benchmarks.reliability.load import run_load
from benchmarks.reliability.soak import run_soak
from benchmarks.reliability.suite import MAX_RSS_GROWTH, MODEL, QUICK


def test_load_completes_every_request_and_frees_every_block(main_server):
    result = run_load(main_server, MODEL, QUICK.clients, QUICK.load_requests)
    assert result.errors == []
    assert result.completed == result.requests == QUICK.load_requests
    assert result.peak_running > 1   # the clients really overlapped
    assert result.pool_whole_after


def test_soak_keeps_the_pool_whole_memory_flat_and_answers_stable(main_server):
    result = run_soak(main_server, MODEL, QUICK.soak_requests, QUICK.soak_wave, QUICK.soak_concurrency)
    assert result.errors == []
    assert result.completed == QUICK.soak_requests
    assert result.idle_points == QUICK.soak_requests // QUICK.soak_wave
    assert result.idle_points_whole == result.idle_points
    assert result.rss_growth < MAX_RSS_GROWTH, (result.rss_second_quarter_mib, result.rss_last_quarter_mib)
    assert result.probe_start == result.probe_end and result.probe_start
