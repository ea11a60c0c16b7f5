"""Engine figures for logs, metrics and benchmarks, derived at the moment they are asked for."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.manager import KVCacheUsage


@dataclass(frozen=True)
class StepStats:
    scheduling_seconds: float   # scheduler + KV bookkeeping (block tables, prefix hashes, forks)
    model_seconds: float        # building inputs, the forward pass and sampling
    num_seqs: int
    num_tokens: int
    num_preemptions: int


@dataclass(frozen=True)
class EngineStats:
    kv_cache: KVCacheUsage
    num_running: int
    num_waiting: int
    num_preemptions: int        # since the engine started
    last_step: StepStats | None
