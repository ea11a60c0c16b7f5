"""A log line every few seconds while the server is busy: throughput, queues, KV cache, prefix cache, and
with speculative decoding the interval's mean acceptance length and acceptance rate."""
from __future__ import annotations

import asyncio
import logging
import time

from pagedllm.entrypoints.openai.serving_engine import ServerState

logger = logging.getLogger(__name__)

STATS_INTERVAL_SECONDS = 10.0


async def log_stats_periodically(state: ServerState, interval: float = STATS_INTERVAL_SECONDS) -> None:
    """Runs until cancelled; logs nothing for an interval in which the engine stayed idle."""
    last_time = time.monotonic()
    last_prompt, last_generation = state.metrics.token_totals()
    last_queries = last_hits = 0
    last_drafts = last_draft_tokens = last_accepted = 0
    while True:
        await asyncio.sleep(interval)
        stats = await state.engine_stats()
        now = time.monotonic()
        prompt, generation = state.metrics.token_totals()
        queries, hits = stats.kv_cache.prefix_cache_queries, stats.kv_cache.prefix_cache_hits
        busy = prompt > last_prompt or generation > last_generation or stats.num_running or stats.num_waiting
        if busy:
            elapsed = now - last_time
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                        (prompt - last_prompt) / elapsed, (generation - last_generation) / elapsed,
                        stats.num_running, stats.num_waiting, 100 * stats.kv_cache.usage,
                        100 * (hits - last_hits) / (queries - last_queries) if queries > last_queries else 0.0)
        spec = stats.spec_decoding
        if spec is not None and busy and spec.num_drafts > last_drafts:
            drafts, accepted = spec.num_drafts - last_drafts, spec.num_accepted_tokens - last_accepted
            logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d tokens, "
                        "Draft acceptance rate: %.1f%%", 1 + accepted / drafts, accepted,
                        spec.num_draft_tokens - last_draft_tokens,
                        100 * accepted / (spec.num_draft_tokens - last_draft_tokens))
        if spec is not None:
            last_drafts, last_draft_tokens, last_accepted = (spec.num_drafts, spec.num_draft_tokens,
                                                             spec.num_accepted_tokens)
        last_time, last_prompt, last_generation, last_queries, last_hits = now, prompt, generation, queries, hits
