"""Prometheus metrics for /metrics, with vLLM's names under a `pagedllm:` prefix.

Request figures (tokens, latencies, finished requests) are counted here as outputs stream
past; engine figures (queues, KV-cache usage, prefix-cache lookups, preemptions, speculative-decoding
acceptance) are read
from a fresh EngineStats at each scrape, so they never drift from the engine's own state.
Each app has its own CollectorRegistry, so several servers can live in one process.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedllm.engine.stats import EngineStats
from pagedllm.outputs import RequestOutput

PREFIX = "pagedllm:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector:
    """Yields the engine's gauges and counters from the latest snapshot it was given."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        for kind, name, text, value in (
                (GaugeMetricFamily, "num_requests_running", "Number of requests in model execution batches.",
                 stats.num_running),
                (GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be processed.",
                 stats.num_waiting),
                (GaugeMetricFamily, "kv_cache_usage_perc",
                 "KV-cache usage: the fraction of KV blocks in use (1 = 100 percent).", stats.kv_cache.usage),
                (GaugeMetricFamily, "kv_cache_total_blocks", "Number of KV blocks in the pool.",
                 stats.kv_cache.num_blocks),
                (GaugeMetricFamily, "kv_cache_free_blocks",
                 "KV blocks held by no request (idle prefix-cache blocks included: they are reusable).",
                 stats.kv_cache.num_free_blocks),
                (GaugeMetricFamily, "kv_cache_pinned_blocks",
                 "KV blocks that cache pins (cache_control) keep in the prefix cache until their TTL ends.",
                 stats.kv_cache.num_pinned_blocks),
                (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 stats.kv_cache.prefix_cache_queries),
                (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 stats.kv_cache.prefix_cache_hits),
                (CounterMetricFamily, "num_preemptions", "Cumulative number of preemptions by the engine.",
                 stats.num_preemptions)):
            family = kind(PREFIX + name, text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        if stats.spec_decoding is not None:
            yield from self._spec_decoding(stats.spec_decoding)
        if stats.kv_disk is not None:
            yield from self._kv_tiers(stats.kv_disk)
        if stats.max_lora:   # 0: LoRA is off
            yield self._lora_requests_info(stats)
        if stats.data_parallel is not None:
            yield from self._data_parallel(stats.data_parallel)
        if stats.kv_swap is not None:
            yield from self._kv_swap(stats.kv_swap)

    def _lora_requests_info(self, stats: EngineStats) -> GaugeMetricFamily:
        """vLLM's: the adapters of the running and of the waiting requests as comma-separated labels, the
        value the time they were read (seconds since the epoch)."""
        family = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        family.add_metric([str(stats.max_lora), ",".join(sorted(stats.running_lora_adapters)),
                           ",".join(sorted(stats.waiting_lora_adapters))], time.time())
        return family

    def _data_parallel(self, dp):
        """Each data-parallel replica's own figures, labelled engine="<replica index>" (vLLM's label) under dp_
        names, so that summing the unlabelled families above never counts a replica twice; and the router's
        choices by reason."""
        for kind, name, text, figure in (
                (GaugeMetricFamily, "dp_num_requests_running", "Requests in the replica's batches.",
                 lambda s: s.num_running),
                (GaugeMetricFamily, "dp_num_requests_waiting", "Requests waiting in the replica.",
                 lambda s: s.num_waiting),
                (GaugeMetricFamily, "dp_kv_cache_usage_perc", "The replica's fraction of KV blocks in use.",
                 lambda s: s.kv_cache.usage),
                (CounterMetricFamily, "dp_prefix_cache_queries", "Prompt tokens the replica looked up in its prefix "
                 "cache.", lambda s: s.kv_cache.prefix_cache_queries),
                (CounterMetricFamily, "dp_prefix_cache_hits", "Prompt tokens the replica found in its prefix cache.",
                 lambda s: s.kv_cache.prefix_cache_hits)):
            family = kind(PREFIX + name, text, labels=["model_name", "engine"])
            for index, stats in dp.replicas.items():
                family.add_metric([self.model_name, str(index)], figure(stats))
            yield family
        family = CounterMetricFamily(PREFIX + "dp_routed_requests", "Requests the router sent to the replica, by "
                                     f"reason (routing {dp.routing}): prefix, its cached prefix of the prompt was the "
                                     "longest; balance, another's was longer but over the imbalance bound; load, no "
                                     "replica held any of it.", labels=["model_name", "engine", "reason"])
        for index, reasons in dp.routed.items():
            for reason, count in reasons.items():
                family.add_metric([self.model_name, str(index), reason], count)
        yield family

    def _kv_tiers(self, disk):
        """The KV disk tier's figures, labelled tier="disk" (the RAM tier's are the kv_cache_* and prefix_cache_*
        ones above)."""
        for kind, name, text, value in (
                (GaugeMetricFamily, "kv_tier_blocks", "KV blocks the tier holds.", disk.num_blocks),
                (GaugeMetricFamily, "kv_tier_capacity_blocks", "KV blocks the tier may hold.", disk.capacity_blocks),
                (CounterMetricFamily, "kv_tier_hit_blocks", "KV blocks read back for a prefix hit.", disk.hit_blocks),
                (CounterMetricFamily, "kv_tier_read_failures", "KV block files missing or failing their checksum.",
                 disk.read_failures),
                (CounterMetricFamily, "kv_tier_spilled_blocks", "KV blocks written to the tier.", disk.spilled_blocks),
                (CounterMetricFamily, "kv_tier_evicted_blocks", "KV blocks deleted to stay within the quota.",
                 disk.evicted_blocks),
                (CounterMetricFamily, "kv_tier_read_bytes", "Bytes read from the tier.", disk.bytes_read),
                (CounterMetricFamily, "kv_tier_written_bytes", "Bytes written to the tier.", disk.bytes_written),
                (CounterMetricFamily, "kv_tier_stale_files_removed",
                 "Files removed at start-up: half-written ones (a process killed mid-write) and old swaps.",
                 disk.stale_files_removed)):
            family = kind(PREFIX + name, text, labels=["model_name", "tier"])
            family.add_metric([self.model_name, "disk"], value)
            yield family

    def _kv_swap(self, swap):
        """Preemption by swap, labelled with the tier the swapped blocks go to (tier="ram": swap_space)."""
        for kind, name, text, value in (
                (GaugeMetricFamily, "kv_tier_swapped_blocks", "KV blocks of swapped-out requests held now.",
                 swap.num_blocks),
                (CounterMetricFamily, "kv_tier_swap_outs", "Requests swapped out on preemption.", swap.swap_outs),
                (CounterMetricFamily, "kv_tier_swap_ins", "Swapped-out requests swapped back in.", swap.swap_ins),
                (CounterMetricFamily, "kv_tier_swapped_out_bytes", "KV bytes copied out by swap-outs.", swap.bytes_out),
                (CounterMetricFamily, "kv_tier_swapped_in_bytes", "KV bytes copied back by swap-ins.", swap.bytes_in),
                (CounterMetricFamily, "kv_tier_swap_refused", "Swap-outs refused for want of room (recomputed).",
                 swap.refused)):
            family = kind(PREFIX + name, text, labels=["model_name", "tier"])
            family.add_metric([self.model_name, swap.tier], value)
            yield family

    def _spec_decoding(self, spec):
        """vLLM's speculative-decoding counters; acceptance per position carries a `position` label."""
        for name, text, value in (
                ("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
                ("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens)):
            family = CounterMetricFamily(PREFIX + name, text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", labels=["model_name", "position"])
        for position, value in enumerate(spec.num_accepted_tokens_per_pos):
            family.add_metric([self.model_name, str(position)], value)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)

        def counter(name: str, text: str, labelnames: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, text, ("model_name", *labelnames), registry=self.registry)

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, text, ("model_name",), buckets=buckets, registry=self.registry)

        labels = {"model_name": model_name}
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(**labels)
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.").labels(**labels)
        self._request_success = counter("request_success", "Count of successfully processed requests.",
                                        ("finished_reason",))
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Histogram of time to first token "
                                             "in seconds.", _LATENCY_BUCKETS).labels(**labels)
        self.time_per_output_token = histogram("time_per_output_token_seconds", "Histogram of time per output "
                                               "token in seconds.", _TOKEN_LATENCY_BUCKETS).labels(**labels)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Histogram of end to end request "
                                             "latency in seconds.", _LATENCY_BUCKETS).labels(**labels)

    def exposition(self, stats: EngineStats) -> bytes:
        """The Prometheus text format, with the engine figures of `stats`."""
        self._engine.stats = stats
        return generate_latest(self.registry)

    def token_totals(self) -> tuple[float, float]:
        """(prompt, generation) tokens counted so far."""
        labels = {"model_name": self.model_name}
        return tuple(self.registry.get_sample_value(f"{PREFIX}{name}_total", labels) or 0.0
                     for name in ("prompt_tokens", "generation_tokens"))

    async def track(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Passes a DELTA-kind output stream through, counting its tokens and timing it."""
        arrival = time.monotonic()
        first_token_at = last_token_at = None
        num_token_steps = 0
        async for output in stream:
            new_tokens = sum(len(completion.token_ids) for completion in output.outputs)
            if new_tokens:
                last_token_at = time.monotonic()
                num_token_steps += 1
                if first_token_at is None:
                    first_token_at = last_token_at
                    self.time_to_first_token.observe(first_token_at - arrival)
                    self.prompt_tokens.inc(len(output.prompt_token_ids))
                self.generation_tokens.inc(new_tokens)
            if output.finished:
                self.e2e_request_latency.observe(time.monotonic() - arrival)
                if num_token_steps > 1:
                    self.time_per_output_token.observe((last_token_at - first_token_at) / (num_token_steps - 1))
                reason = output.outputs[0].finish_reason if output.outputs else None
                self._request_success.labels(model_name=self.model_name, finished_reason=reason).inc()
            yield output
