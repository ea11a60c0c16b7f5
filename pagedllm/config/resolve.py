"""What the "auto" and unset engine knobs become on this machine and model: device, dtypes, lengths, budgets."""
from __future__ import annotations

import torch

from pagedllm.config.engine import EngineConfig

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 2**30  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_fast_bfloat16() -> bool:
    """AMX or AVX-512-BF16: bfloat16 matmuls run several times faster than float32 here. oneDNN also
    "supports" bfloat16 on AVX-512 without BF16 (Skylake-X, Cascade Lake, Ice Lake) by widening it to float32,
    which runs slower than float32 itself and leaves the kernels without bfloat16 products (docs/performance.md)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """What "auto" means: on a CPU with fast bfloat16, bfloat16; on other CPUs, float32 (float16
    is slow there); on CUDA, the checkpoint's own dtype (float32 for dequantized GGUF files)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_fast_bfloat16() else torch.float32
    if checkpoint_dtype in ("bfloat16", "float16"):
        return getattr(torch, checkpoint_dtype)
    return torch.float32


def engine_chose_float32(dtype: str, model_dtype: torch.dtype, device: torch.device) -> bool:
    """dtype auto resolved to float32 on a CPU without fast bfloat16: float32 was picked for the speed of its
    arithmetic, not asked for, so the data the kernels only read (KV cache, adapters) may be held in bfloat16."""
    return dtype == "auto" and device.type == "cpu" and model_dtype == torch.float32


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, model_dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """The KV cache's element type. "auto" is the model dtype, except where the engine chose float32 itself
    (engine_chose_float32): there the cache holds bfloat16, as it would for the checkpoint's own dtype, and
    decode attention reads half the bytes (docs/performance.md: the shared workload 1.10x on AVX2, 99.6% top-1
    agreement with a float32 cache). fp8_e5m2 (vLLM's name) is torch.float8_e5m2; int8 caches also keep a
    float32 scale per token and kv head."""
    if kv_cache_dtype == "auto":
        return torch.bfloat16 if engine_chose_float32(dtype, model_dtype, device) else model_dtype
    if kv_cache_dtype == "float32" and model_dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype float32 is for float32 models; this one runs in {model_dtype} "
                         "(dtype): use auto, or a narrower cache")
    return torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else getattr(torch, kv_cache_dtype)


def resolve_lora_dtype(lora_dtype: str, dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The adapters' element type. "auto" is the model dtype, except where the engine chose float32 itself
    (engine_chose_float32): there bfloat16, half the bytes a step's adapter updates read (docs/lora.md)."""
    if lora_dtype == "auto":
        return torch.bfloat16 if engine_chose_float32(dtype, model_dtype, device) else model_dtype
    return getattr(torch, lora_dtype)


def resolve_max_model_len(config: EngineConfig, context_length: int) -> int:
    """max_model_len, or the model's whole context; never more than the context."""
    wanted = config.max_model_len or context_length
    if wanted > context_length:
        raise ValueError(f"max_model_len must be <= {context_length} (the model's context: max_position_embeddings, "
                         f"times the factor of dynamic rope scaling), got {wanted}")
    return wanted


def chunks_prefill(config: EngineConfig, is_pooling: bool) -> bool:
    """Pooling prompts are computed whole, in one step: the pooler (and an encoder's attention) sees them entire."""
    return config.enable_chunked_prefill and not is_pooling


def resolve_token_budget(config: EngineConfig, max_model_len: int, is_pooling: bool) -> int:
    """max_num_batched_tokens: a step's tokens; without chunked prefill it must hold a whole prompt."""
    budget = config.max_num_batched_tokens
    if chunks_prefill(config, is_pooling):
        return budget or DEFAULT_MAX_NUM_BATCHED_TOKENS
    if budget is not None and budget < max_model_len:
        reason = "for a pooling model (its prompts run whole)" if is_pooling else "when enable_chunked_prefill is False"
        raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) {reason}")
    return budget or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)


def check_draft_vocab(draft_vocab_size: int, target_vocab_size: int) -> None:
    """draft_model speculation proposes the target's token ids: the two models must share a vocabulary."""
    if draft_vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config.model must have the target's vocabulary ({target_vocab_size} tokens, "
                         f"the same tokenizer), got a draft model with {draft_vocab_size}")


def check_pooling_config(config: EngineConfig) -> None:
    """What a pooling model cannot run with."""
    if config.enable_lora:
        raise ValueError("enable_lora applies to generating models; this is a pooling model")
    if config.speculative_config is not None:
        raise ValueError("speculative_config applies to generation; a pooling model generates nothing")
    if config.tensor_parallel_size > 1:
        raise ValueError(f"pooling models run with tensor_parallel_size 1, got {config.tensor_parallel_size}")


def num_kv_blocks(budget: int, bytes_per_block: int, block_size: int) -> int:
    """How many KV blocks `budget` bytes hold (bytes_per_block: of every model sharing the block ids)."""
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no KV block; one block of "
                         f"{block_size} tokens needs {bytes_per_block} bytes")
    return num_blocks


def gpu_kv_cache_budget(total: int, utilization: float, peak_torch: int, non_torch: int) -> int:
    """Bytes the KV cache may take on a GPU of `total` bytes: the engine's share (utilization), less what the
    profile run showed the engine needs besides: the peak of its tensors (weights, activations, sampler)
    and the memory torch does not manage (CUDA context, NCCL, other processes on the device)."""
    budget = int(total * utilization) - peak_torch - non_torch
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} gives the engine {int(total * utilization)} of "
                         f"{total} bytes, but the profile run needs {peak_torch} bytes of tensors and {non_torch} "
                         f"bytes outside torch already: no room for a KV cache; raise gpu_memory_utilization")
    return budget
