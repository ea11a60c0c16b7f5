"""Rope scaling kinds: their parameters read from a checkpoint, and the inverse frequencies each computes.

The formulas are transformers' (modeling_rope_utils.py), so a checkpoint rotates here as it does there:
`linear` and `llama3` rescale the frequencies once; `yarn` blends interpolated and extrapolated
frequencies and scales cos/sin by an attention factor; `longrope` (Phi-3) has short and long per-frequency
factors, the long ones for sequences past the original context; `dynamic` NTK raises the base with the
sequence's length once it passes the original context.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
# Kinds whose frequencies depend on the sequence's length, not only on the position.
LENGTH_DEPENDENT_TYPES = ("longrope", "dynamic")
_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
}
_KNOWN = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("factor", "attention_factor"),
}


def resolve_rope_scaling(rope: Mapping[str, Any] | None, max_position_embeddings: int,
                         original_max_position_embeddings: int | None = None) -> dict | None:
    """Rope scaling in HF form keyed by "rope_type" with transformers' defaults filled in (None for plain
    rope); ValueError for kinds we cannot run or missing parameters. original_max_position_embeddings:
    the config's top-level field (Phi-3 keeps it there), which wins over the dict's, as in transformers."""
    if not rope:
        return None
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "su":   # Phi-3's early name for longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return None
    scaling = {key: value for key, value in rope.items()
               if key not in ("type", "rope_type", "rope_theta", "partial_rotary_factor") and value is not None}
    if rope_type in ("llama3", "yarn", "longrope"):
        scaling["original_max_position_embeddings"] = (
            original_max_position_embeddings or scaling.get("original_max_position_embeddings")
            or max_position_embeddings)
    if rope_type == "dynamic":   # transformers scales against the configured context
        scaling["original_max_position_embeddings"] = max_position_embeddings
    if rope_type in ("yarn", "longrope") and "factor" not in scaling:
        scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    missing = [key for key in _REQUIRED[rope_type] if scaling.get(key) is None]
    if missing:
        raise ValueError(f"Rope type {rope_type!r} needs {', '.join(missing)}")
    if rope_type in ("yarn", "longrope"):
        scaling["attention_factor"] = _attention_factor(rope_type, scaling)
    return {"rope_type": rope_type, **scaling}


def context_length(max_position_embeddings: int, scaling: dict | None) -> int:
    """The longest sequence the model serves: dynamic NTK (as vLLM reads it) stretches the configured
    context by its factor; the other kinds already state their stretched context."""
    if scaling is not None and scaling["rope_type"] == "dynamic":
        return int(max_position_embeddings * scaling["factor"])
    return max_position_embeddings


def _attention_factor(rope_type: str, scaling: dict) -> float:
    """The factor yarn and longrope multiply cos and sin by."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor", 1.0)
    if rope_type == "yarn":
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    if factor > 1:   # longrope
        return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))
    return 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def default_inv_freq(dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(dim: int, theta: float, scaling: dict | None, long: bool = False) -> torch.Tensor:
    """[dim / 2] float32 inverse frequencies of a kind whose frequencies do not change with the length
    (longrope: its short or long set)."""
    base = default_inv_freq(dim, theta)
    kind = None if scaling is None else scaling["rope_type"]
    if kind is None or kind == "dynamic":   # dynamic: within the original context, the plain frequencies
        return base
    if kind == "linear":
        return base / scaling["factor"]
    if kind == "llama3":
        return _llama3_scale(base, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.shape != base.shape:
        raise ValueError(f"longrope {'long' if long else 'short'}_factor has {len(factors)} values; the rotary "
                         f"dimension {dim} needs {dim // 2}")
    return 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def dynamic_ntk_inv_freq(dim: int, theta: float, scaling: dict, seq_lens: torch.Tensor) -> torch.Tensor:
    """[len(seq_lens), dim / 2]: each row the frequencies dynamic NTK uses for a sequence of that length
    (the base raised once the length passes the original context), float32 as transformers computes them."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    lengths = seq_lens.clamp(min=original)
    base = theta * ((factor * lengths / original) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device).float() / dim
    return 1.0 / (base.float()[:, None] ** exponents[None, :])


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths slowed by `factor`, short kept, a smooth blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those turning more than beta_fast times kept, a linear ramp between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def rope_length_key(scaling: dict | None, prompt_len: int, max_model_len: int) -> str | None:
    """For kinds whose frequencies depend on the sequence's length: what a prompt's cached K/V depend on
    beyond its tokens (a prompt past the original context is rotated by the long factors, or dynamic
    NTK's base for its length), so prefix caching keeps such blocks apart. None where nothing does."""
    if scaling is None or scaling["rope_type"] not in LENGTH_DEPENDENT_TYPES:
        return None
    original = scaling["original_max_position_embeddings"]
    if max_model_len <= original or prompt_len <= original:
        return None
    return "rope:long" if scaling["rope_type"] == "longrope" else f"rope:ntk-{prompt_len}"
