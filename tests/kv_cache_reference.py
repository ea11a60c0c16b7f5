"""K/V as each kv_cache_dtype stores them, written from the dtype's definition, and a transformers cache that
stores them so: the reference for the engine's quantized KV caches."""
import torch
from transformers import DynamicCache

TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "fp8_e5m2": "float8_e5m2"}


def round_like_the_cache(states: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """K/V [..., head_dim] as a cache of that dtype gives them back, written out from its definition: a
    cast (round to nearest even); for int8 a symmetric scale per token and kv head, absmax / 127; for auto
    (the model's own dtype, float32 here) the values as they are."""
    if kv_cache_dtype == "auto":
        return states
    if kv_cache_dtype != "int8":
        return states.to(getattr(torch, TORCH_DTYPES[kv_cache_dtype])).float()
    scale = states.abs().amax(-1, keepdim=True) / 127
    return torch.where(scale > 0, torch.round(states / scale.clamp_min(1e-30)).clamp(-127, 127) * scale, 0.0)


class RoundingCache(DynamicCache):
    """transformers' cache, storing each new K/V row rounded as our KV cache dtype stores it: attention then
    reads rounded K/V for every position, its own included, as our kernels read the cache."""

    def __init__(self, kv_cache_dtype: str):
        super().__init__()
        self.kv_cache_dtype = kv_cache_dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = (round_like_the_cache(states, self.kv_cache_dtype) for states in (key_states, value_states))
        return super().update(*rounded, layer_idx, *args, **kwargs)
