"""Engine figures for logs, metrics and benchmarks, derived at the moment they are asked for; several engines' figures
combined into one (data-parallel replicas)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedllm.kv.usage import KVCacheUsage
from pagedllm.spec_decode.metrics import SpecDecodingStats


@dataclass(frozen=True)
class StepStats:
    scheduling_seconds: float   # schedule() and update_from_output(): KV bookkeeping, prefix hashes, stops
                                # (not the output processing after it: detokenizing, outputs)
    prepare_seconds: float      # the runner's step preparation: batch update, input arrays and tensors
    model_seconds: float        # the forward pass and sampling
    num_seqs: int
    num_tokens: int
    num_preemptions: int
    block_copies: list[tuple[int, int]] = ()   # (source, destination) blocks copied on write in this step
    num_loras: int = 0          # distinct LoRA adapters the step ran (at most max_loras)


@dataclass(frozen=True)
class KVDiskStats:
    """The KV disk tier (--kv-cache-dir) since start-up: blocks and the bytes that moved."""
    num_blocks: int         # block files indexed now
    capacity_blocks: int    # what --kv-cache-disk-bytes holds
    hit_blocks: int         # read back into RAM for a prefix hit
    read_failures: int      # missing or damaged files (their tokens recomputed)
    spilled_blocks: int     # evicted from RAM and written
    evicted_blocks: int     # deleted to stay within the quota
    bytes_read: int
    bytes_written: int
    stale_files_removed: int   # at start-up: half-written files (a process killed mid-write) and old swaps


@dataclass(frozen=True)
class KVSwapStats:
    """Preemption by swap since start-up (preemption_mode swap or auto), in the tier swapped blocks go to."""
    tier: str                 # "disk" (the kv_cache_dir's quota) or "ram" (swap_space)
    capacity_blocks: int
    num_blocks: int           # swapped-out blocks held now
    swap_outs: int            # requests swapped out
    swap_ins: int             # requests swapped back in
    blocks_out: int
    blocks_in: int
    blocks_reused: int        # copied out, then found still in the prefix cache on swap-in
    bytes_out: int
    bytes_in: int
    refused: int              # swap-outs refused for want of room (those requests recompute)
    failed_blocks: int        # copies that could not be read back (their tokens recomputed)
    recomputed_preemptions: int   # preemptions that recompute (by choice or refusal)


@dataclass(frozen=True)
class EngineStats:
    kv_cache: KVCacheUsage
    num_running: int
    num_waiting: int
    num_preemptions: int        # since the engine started
    last_step: StepStats | None
    spec_decoding: SpecDecodingStats | None = None   # acceptance counters since start, with speculation on
    kv_disk: KVDiskStats | None = None               # with a KV disk tier
    # vLLM's lora_requests_info: the adapters (by name) of running and of waiting requests, and max_loras (0: off).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    kv_swap: KVSwapStats | None = None               # with preemption by swap possible
    data_parallel: DataParallelStats | None = None   # data-parallel replicas combined (DPAsyncLLM.stats)


@dataclass(frozen=True)
class DataParallelStats:
    """Beside the replicas' combined figures: each live replica's own, and where the router sent requests."""
    routing: str                         # data_parallel_routing: prefix or least-loaded
    replicas: dict[int, EngineStats]     # by replica index
    routed: dict[int, dict[str, int]]    # replica index -> requests sent to it, by reason (dp_router.ROUTING_REASONS)


def sum_figures(figures: list, same: tuple[str, ...] = ()):
    """One figures dataclass for several engines': every field summed, but those named in `same` (equal in all)."""
    first = figures[0]
    return type(first)(**{f.name: getattr(first, f.name) if f.name in same else sum(getattr(x, f.name) for x in figures)
                          for f in dataclasses.fields(first)})


def combine_stats(stats: list[EngineStats]) -> EngineStats:
    """One engine's figures for several: counts, blocks and the disk tiers' figures are summed (so usage is all
    used blocks over all blocks, and the prefix hit rate all hits over all lookups); the last step is the slowest
    replica's time with every replica's sequences and tokens."""
    disks = [s.kv_disk for s in stats if s.kv_disk is not None]
    swaps = [s.kv_swap for s in stats if s.kv_swap is not None]
    steps = [s.last_step for s in stats if s.last_step is not None]
    last_step = StepStats(scheduling_seconds=max(s.scheduling_seconds for s in steps),
                          prepare_seconds=max(s.prepare_seconds for s in steps),
                          model_seconds=max(s.model_seconds for s in steps),
                          num_seqs=sum(s.num_seqs for s in steps), num_tokens=sum(s.num_tokens for s in steps),
                          num_preemptions=sum(s.num_preemptions for s in steps),
                          num_loras=sum(s.num_loras for s in steps)) if steps else None
    return EngineStats(kv_cache=sum_figures([s.kv_cache for s in stats], same=("block_size",)),
                       num_running=sum(s.num_running for s in stats), num_waiting=sum(s.num_waiting for s in stats),
                       num_preemptions=sum(s.num_preemptions for s in stats), last_step=last_step,
                       spec_decoding=SpecDecodingStats.combined([s.spec_decoding for s in stats if s.spec_decoding]),
                       kv_disk=sum_figures(disks) if disks else None,
                       kv_swap=sum_figures(swaps, same=("tier",)) if swaps else None,
                       running_lora_adapters=_names_on_any(s.running_lora_adapters for s in stats),
                       waiting_lora_adapters=_names_on_any(s.waiting_lora_adapters for s in stats),
                       max_lora=stats[0].max_lora)


def _names_on_any(per_replica) -> tuple[str, ...]:
    return tuple(sorted(set().union(*per_replica)))
