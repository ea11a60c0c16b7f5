"""Rotary position embeddings (the rotate-half layout Hugging Face checkpoints use)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedllm.model.ops import _C, on_cpu_kernel


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: llama3, linear")


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


@dataclass
class Rotation:
    """One step's rotary embedding: built once per step, applied by every layer."""
    positions: torch.Tensor   # [tokens] int64
    table: torch.Tensor       # [max_positions, head_dim] float32: cos of each angle, then sin
    _cos_sin_by_dtype: dict = field(default_factory=dict, repr=False)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] -> rotated by the rotate-half rule (in place on CPU)."""
        if on_cpu_kernel(x, 32) and x.stride(-1) == 1:
            _C.rotary_embedding(x, self.positions, self.table)
            return x
        cos, sin = self._cos_sin(x.dtype)
        return x * cos + _rotate_half(x) * sin

    def _cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, 1, head_dim] each, in the model dtype, as Hugging Face applies them."""
        if dtype not in self._cos_sin_by_dtype:
            cos, sin = self.table[self.positions].chunk(2, dim=-1)
            self._cos_sin_by_dtype[dtype] = (torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype),
                                             torch.cat((sin, sin), dim=-1).unsqueeze(1).to(dtype))
        return self._cos_sin_by_dtype[dtype]


class RotaryEmbedding:
    """cos/sin of every position's angles up to max_positions, float32."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device):
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.table = torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)

    def at(self, positions: torch.Tensor) -> Rotation:
        return Rotation(positions, self.table)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
