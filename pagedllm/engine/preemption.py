"""How a preempted request gives back its blocks: recompute (free them, prefill again on resume) or swap
(copy them out, copy them back on resume), and auto's choice between the two by measured cost.

auto's rule (docs/kv-cache.md, "Preemption"): recomputing costs the request's computed tokens times the
engine's measured prefill seconds per token; swapping costs its copied blocks, out and back in, times the
measured seconds per block moved. Swap wins when it costs less, and while either figure is unmeasured
(a first swap measures the copies; every preempted request has had a prefill step measured).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedllm.config import PREEMPTION_MODES
from pagedllm.kv.manager import KVCacheManager

logger = logging.getLogger(__name__)

SMOOTHING = 0.2        # weight of the newest measurement in the running averages
LOG_EVERY = 100        # auto logs its choice on the first preemption and every LOG_EVERY-th after


@dataclass
class PreemptionCounters:
    swapped: int = 0        # preemptions that swapped
    recomputed: int = 0     # preemptions that recompute, by choice or for want of swap room


class PreemptionPolicy:
    def __init__(self, mode: str):
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {mode!r}")
        self.mode = mode
        self.prefill_seconds_per_token: float | None = None
        self.swap_seconds_per_block: float | None = None
        self.counters = PreemptionCounters()

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step's forward pass over num_tokens tokens, most of them prefill."""
        if num_tokens > 0 and seconds > 0:
            self.prefill_seconds_per_token = _smoothed(self.prefill_seconds_per_token, seconds / num_tokens)

    def observe_swap(self, num_blocks: int, seconds: float) -> None:
        """A step's swap copies (out and in) of num_blocks blocks took seconds of the step."""
        if num_blocks > 0 and seconds > 0:
            self.swap_seconds_per_block = _smoothed(self.swap_seconds_per_block, seconds / num_blocks)

    def recompute_seconds(self, num_computed_tokens: int) -> float | None:
        if self.prefill_seconds_per_token is None:
            return None
        return num_computed_tokens * self.prefill_seconds_per_token

    def swap_seconds(self, num_blocks: int) -> float | None:
        """Both copies: out now, back in on resume."""
        if self.swap_seconds_per_block is None:
            return None
        return 2 * num_blocks * self.swap_seconds_per_block

    def wants_swap(self, num_computed_tokens: int, num_blocks: int) -> bool:
        """Whether to try swapping a request with this much computed KV (num_blocks of it to copy)."""
        if self.mode != "auto":
            return self.mode == "swap"
        recompute, swap = self.recompute_seconds(num_computed_tokens), self.swap_seconds(num_blocks)
        chosen = recompute is None or swap is None or swap < recompute
        number = self.counters.swapped + self.counters.recomputed + 1
        if number == 1 or number % LOG_EVERY == 0:
            logger.info("preemption %d (auto): %s, for %d computed tokens: recompute ~%s s, swap of %d blocks ~%s s",
                        number, "swap" if chosen else "recompute", num_computed_tokens, _seconds(recompute),
                        num_blocks, _seconds(swap))
        return chosen

    def swap_out(self, kv_manager: KVCacheManager, request_id: str, num_computed_tokens: int) -> bool:
        """Swaps a preempted request's computed blocks out if this policy wants it and the KV manager's swap
        space has room; whether it did (else it recomputes). Counted either way, once it has KV to keep."""
        if kv_manager.swap is None or not num_computed_tokens:
            return False
        num_blocks = kv_manager.num_blocks_to_swap(request_id, num_computed_tokens)
        swapped = self.wants_swap(num_computed_tokens, num_blocks) and kv_manager.swap_out(request_id,
                                                                                           num_computed_tokens)
        if swapped:
            self.counters.swapped += 1
        else:
            self.counters.recomputed += 1
        return swapped


def _smoothed(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value


def _seconds(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:.4f}"
