"""Times an engine's pure decode steps: the figure both `bench structured` and `bench logit-controls` compare.

A step counts only when every request of the batch decoded one token in it, so prefill and the batch's
ragged end are left out and the modes being compared time the same kind of step.
"""
from __future__ import annotations

import time


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def decode_step_seconds(engine, prompts: list[list[int]], params_list: list, tag: str
                        ) -> list[tuple[float, float, float]]:
    """Runs the requests to their end; for each step in which all of them decoded, its wall time, the part
    outside the model (the scheduler's share holds a grammar's bitmask fill and the matchers' advance) and
    the process's CPU time (steadier than wall time on a machine that other jobs share)."""
    batch = len(prompts)
    for index, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"{tag}-{index}", {"prompt_token_ids": prompt}, params)
    seconds = []
    while engine.has_unfinished_requests():
        started, cpu_started = time.perf_counter(), time.process_time()
        engine.step()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        stats = engine.last_step_stats
        if stats is not None and stats.num_seqs == batch and stats.num_tokens == batch:
            seconds.append((elapsed, stats.scheduling_seconds + stats.prepare_seconds, cpu))
    return seconds
