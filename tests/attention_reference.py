"""Dense references for the paged-attention kernels, shared by their tests: what a cache of each dtype holds,
caches of noise, causal SDPA, and the tolerance each query dtype earns."""
import torch

from pagedllm.model.attention.cache import CacheTensor

# (model dtype, KV cache dtype) pairs the engine can make: kv_cache_dtype "auto" is the model dtype.
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
               (torch.float32, torch.float8_e5m2), (torch.float32, torch.int8),
               (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16),
               (torch.bfloat16, torch.float8_e5m2), (torch.bfloat16, torch.int8)]


def tolerance(dtype):
    """The reference attends over the very values the cache holds (dequantized), so a cache dtype adds
    no error of its own. float32 queries: the same float arithmetic in another order, int8 scales
    applied to a dot product rather than to each of its terms (a few float roundings, ~1e-7 relative,
    on outputs of size ~1). bfloat16 queries: the output is rounded to bfloat16 (2^-9 relative), and
    over a bfloat16 cache the probabilities are too (each 2^-9 relative, so at most 2^-9 * max |v|,
    ~1e-2 for standard normal values): 2e-2 leaves a margin."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def reference_quantize(rows, cache_dtype):
    """What a cache of cache_dtype should hold for rows [..., head_dim]: torch's own rounding for the
    float dtypes; for int8, round(x / scale) with scale = absmax / 127 per row (zeros, scale 0, for a
    zero row). Returns the elements and the scales (None but for int8)."""
    if cache_dtype != torch.int8:
        return rows.to(cache_dtype), None
    scales = rows.float().abs().amax(-1) / 127
    return torch.nan_to_num(torch.round(rows.float() / scales[..., None])).to(torch.int8), scales


def dequantize(elements, scales):
    return elements.float() if scales is None else elements.float() * scales[..., None]


def noise_cache(shape, scales_shape, cache_dtype, generator):
    """A cache whose every slot holds noise, scales included, as unwritten slots may."""
    elements = torch.randn(shape, generator=generator)
    if cache_dtype != torch.int8:
        return CacheTensor(elements.to(cache_dtype))
    scales = torch.rand(scales_shape, generator=generator)
    return CacheTensor((elements * 40).clamp(-127, 127).to(torch.int8), scales)


def caches_of(k_cache, v_cache):
    """The kernels' cache arguments."""
    return k_cache.data, v_cache.data, k_cache.scales, v_cache.scales


def causal_reference(q, keys, values, context_len, scale, sliding_window=None, softcap=None):
    """q: [chunk, heads, head_dim] at positions context_len..; keys/values: [context + chunk, kv_heads, head_dim].
    With sliding_window a query at p sees keys p - window + 1 .. p; with softcap scores become
    softcap * tanh(score / softcap), as transformers' Mistral and Gemma 2 compute them."""
    mask, scores, _, values = causal_scores(q, keys, values, context_len, scale, sliding_window, softcap)
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values).transpose(0, 1)


def causal_scores(q, keys, values, context_len, scale, sliding_window=None, softcap=None):
    """causal_reference's parts in float32, heads first: the mask [heads-broadcast, chunk, keys], the scores
    [heads, chunk, keys], and keys and values repeated to every query head [heads, keys, head_dim]."""
    positions = torch.arange(context_len, context_len + q.shape[0])[:, None]
    key_index = torch.arange(keys.shape[0])[None, :]
    mask = key_index <= positions
    if sliding_window is not None:
        mask &= key_index > positions - sliding_window
    group = q.shape[1] // keys.shape[1]
    keys, values = (part.float().repeat_interleave(group, dim=1).transpose(0, 1) for part in (keys, values))
    scores = q.float().transpose(0, 1) @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return mask, scores, keys, values
