"""ModelInfo: the loaded model's facts that benchmarks and logs report, read through the engine's public face."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.worker.cascade_choice import CascadeChoice


@dataclass(frozen=True)
class ModelInfo:
    """Of rank 0 (each tensor-parallel rank holds its own share): its weights, its KV pool and how it runs."""
    architecture: str
    dtype: str                # the activations' (and float weights') dtype
    kv_cache_dtype: str
    attention_backend: str
    weight_bytes: int         # every parameter and buffer the model holds, quantized ones as stored
    weight_summary: str       # the weights' formats, as logged at start-up
    kv_pool_bytes: int        # every layer's K and V cache, int8 scales included
    num_kv_blocks: int
    block_size: int
    cascade_attention: CascadeChoice   # enable_cascade_attention resolved at start-up: its rule and timings


def kv_pool_bytes(kv_caches) -> int:
    """Bytes of a KV pool: every layer's K and V cache, int8 scales included."""
    return sum(cache.data.nbytes + (cache.scales.nbytes if cache.scales is not None else 0)
               for layer in kv_caches for cache in layer)
