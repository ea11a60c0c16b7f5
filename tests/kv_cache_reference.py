"""A transformers cache that stores K/V as each of the engine's kv_cache_dtype values does: the reference for
the engine's reduced-precision KV caches."""
import torch
from transformers import DynamicCache


class RoundingCache(DynamicCache):
    """transformers' cache, storing each new K/V row as a kv_cache_dtype cache holds it: rounded to nearest
    (bfloat16, float16, fp8 e5m2), or for int8 scaled by its absmax / 127 and rounded. Attention then reads
    the rounded rows, the current token's included, as the engine's kernels do."""

    def __init__(self, cache_dtype: torch.dtype):
        super().__init__()
        self.cache_dtype = cache_dtype

    def round(self, rows: torch.Tensor) -> torch.Tensor:
        if self.cache_dtype != torch.int8:
            return rows.to(self.cache_dtype).to(rows.dtype)
        scales = rows.abs().amax(-1, keepdim=True) / 127
        return torch.where(scales > 0, torch.round(rows / scales).clamp(-127, 127) * scales, 0)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self.round(key_states), self.round(value_states), layer_idx, *args, **kwargs)
