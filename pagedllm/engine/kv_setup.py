"""Sizing the KV cache and opening its disk tier and swap space: start-up work between the loaded workers and
the KV manager."""
from __future__ import annotations

import logging

import torch

from pagedllm.config import EngineConfig
from pagedllm.config.resolve import gpu_kv_cache_budget, num_kv_blocks
from pagedllm.engine.executor.abstract import Executor
from pagedllm.kv.disk_tier import DiskTier
from pagedllm.kv.swap import SwapSpace
from pagedllm.model.config import ModelConfig
from pagedllm.worker.kv_disk_store import HEADER_BYTES, weights_fingerprint
from pagedllm.worker.model_runner import kv_bytes_per_block

logger = logging.getLogger(__name__)

KV_DISK_FORMAT = 1   # of kv_cache_dir's block files; a directory of another format is refused


def kv_block_bytes(config: EngineConfig, model_config: ModelConfig, kv_cache_dtype: torch.dtype) -> int:
    """One KV block's bytes on one rank: what a swap or a disk file moves."""
    return kv_bytes_per_block(model_config, config.block_size, kv_cache_dtype, config.tensor_parallel_size)


def kv_blocks_in(budget: int, config: EngineConfig, model_config: ModelConfig, draft_config: ModelConfig | None,
                 kv_cache_dtype: torch.dtype) -> int:
    """The KV blocks `budget` bytes per rank hold; a draft model's pool has as many blocks, under the same ids,
    in the same budget."""
    per_block = kv_block_bytes(config, model_config, kv_cache_dtype)
    if draft_config is not None:
        per_block += kv_bytes_per_block(draft_config, config.block_size, kv_cache_dtype)
    return num_kv_blocks(budget, per_block, config.block_size)


def profiled_kv_cache_budget(executor: Executor, config: EngineConfig, device: torch.device, num_tokens: int) -> int:
    """Runs the largest step (num_tokens) on every rank and sizes the KV cache from rank 0's device by what it
    showed."""
    peak = executor.collective_rpc("profile_run", num_tokens, min(config.max_num_seqs, num_tokens))
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = gpu_kv_cache_budget(total, config.gpu_memory_utilization, peak, non_torch)
    logger.info("profile run of %d tokens: peak %.2f GiB of tensors, %.2f GiB outside torch; KV cache gets "
                "%.2f GiB of the %.2f GiB that gpu_memory_utilization=%s allows", num_tokens, peak / 2**30,
                non_torch / 2**30, budget / 2**30, total * config.gpu_memory_utilization / 2**30,
                config.gpu_memory_utilization)
    return budget


def open_kv_disk_tier(executor: Executor, config: EngineConfig, model_config: ModelConfig, checkpoint_source,
                      dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> tuple[DiskTier, bytes]:
    """Opens kv_cache_dir (refused if made for another model or cache layout) and indexes its blocks."""
    identity = {"format": KV_DISK_FORMAT, "weights": weights_fingerprint(checkpoint_source),
                "architecture": model_config.architecture, "dtype": str(dtype).removeprefix("torch."),
                "kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
                "block_size": config.block_size, "num_hidden_layers": model_config.num_hidden_layers,
                "num_key_value_heads": model_config.num_key_value_heads, "head_dim": model_config.head_dim}
    root_hash, entries = executor.collective_rpc("open_kv_disk_tier", identity)
    file_bytes = HEADER_BYTES + kv_block_bytes(config, model_config, kv_cache_dtype)
    disk_tier = DiskTier(config.kv_cache_disk_bytes // file_bytes, entries)
    logger.info("KV disk tier: %s, %d of %d blocks (%d bytes each) found", config.kv_cache_dir,
                len(disk_tier), disk_tier.capacity_blocks, file_bytes)
    return disk_tier, root_hash


def open_kv_swap_space(executor: Executor, config: EngineConfig, disk_tier: DiskTier | None,
                       block_bytes: int) -> SwapSpace | None:
    """Room for preempted requests' blocks unless preemption_mode is recompute: the disk tier's quota, else
    swap_space of RAM (None when that holds no block: then every preemption recomputes)."""
    if config.preemption_mode == "recompute":
        return None
    if disk_tier is not None:
        swap_space = SwapSpace(0, disk_tier)
    else:
        capacity = config.swap_space_bytes // block_bytes
        if capacity == 0:
            return None
        swap_space = SwapSpace(capacity)
    executor.collective_rpc("open_kv_swap_space")
    logger.info("preemption %s: swapped blocks go to %s (room for %d blocks)", config.preemption_mode,
                config.kv_cache_dir or f"{config.swap_space} GiB of RAM", swap_space.capacity_blocks)
    return swap_space
