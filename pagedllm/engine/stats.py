"""Engine figures for logs, metrics and benchmarks, derived at the moment they are asked for."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.manager import KVCacheUsage
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
