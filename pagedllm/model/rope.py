"""Rotary position embeddings (the rotate-half layout Hugging Face checkpoints use), over the first
rotary_dim dimensions of each head (all of them but for partial-rotary models such as Phi-4-mini)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.model.kernels import kernel_for
from pagedllm.model.rope_scaling import LENGTH_DEPENDENT_TYPES, dynamic_ntk_inv_freq, inv_freq


def _cos_sin_table(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float) -> torch.Tensor:
    """[len(positions), rotary_dim] float32: cos of each angle, then sin (scaled as yarn and longrope do).
    inv_freq: [rotary_dim / 2], or one row per position."""
    angles = positions.float()[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_factor


@dataclass
class Rotation:
    """One step's rotary embedding: built once per step, applied by every layer."""
    rows: torch.Tensor        # [tokens] int64: each token's row of table
    table: torch.Tensor       # [rows, rotary_dim] float32: cos of each angle, then sin
    kernel: object = None     # csrc's rotary_embedding where it serves (RotaryEmbedding chose), else None
    _cos_sin_by_dtype: dict = field(default_factory=dict, repr=False)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] -> its first rotary_dim dimensions rotated by the rotate-half rule
        (in place on CPU)."""
        rotary_dim = self.table.shape[-1]
        part = x[..., :rotary_dim]
        if self.kernel is not None:
            self.kernel(part, self.rows, self.table)
            return x
        cos, sin = self._cos_sin(x.dtype)
        rotated = part * cos + _rotate_half(part) * sin
        return rotated if rotary_dim == x.shape[-1] else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)

    def _cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, 1, rotary_dim] each, in the model dtype, as Hugging Face applies them."""
        if dtype not in self._cos_sin_by_dtype:
            cos, sin = self.table[self.rows].chunk(2, dim=-1)
            self._cos_sin_by_dtype[dtype] = (torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype),
                                             torch.cat((sin, sin), dim=-1).unsqueeze(1).to(dtype))
        return self._cos_sin_by_dtype[dtype]


class RotaryEmbedding:
    """cos/sin of every position's angles up to max_positions, float32.

    longrope and dynamic NTK choose their frequencies by the sequence's length once it passes the
    original context. As transformers runs them, a step's tokens use the length of the sequence at the
    step's end (the prompt's, for prompt tokens): `at` takes that length per token (rope_lengths)
    wherever max_positions passes the original context (needs_lengths)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device):
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling
        kind = None if scaling is None else scaling["rope_type"]
        self.attention_factor = 1.0 if scaling is None else scaling.get("attention_factor", 1.0)
        self.original = None if scaling is None else scaling.get("original_max_position_embeddings")
        self.needs_lengths = kind in LENGTH_DEPENDENT_TYPES and max_positions > self.original
        self.kind = kind
        positions = torch.arange(max_positions)
        tables = [_cos_sin_table(positions, inv_freq(rotary_dim, theta, scaling), self.attention_factor)]
        if kind == "longrope" and self.needs_lengths:   # the long set's rows follow the short set's
            tables.append(_cos_sin_table(positions, inv_freq(rotary_dim, theta, scaling, long=True),
                                         self.attention_factor))
        self.table = torch.cat(tables).to(device)
        self.max_positions = max_positions
        self.kernel = kernel_for("rotary_embedding", device,
                                 None if rotary_dim % 32 == 0 else f"rotary_dim {rotary_dim}, not a multiple of 32")

    def at(self, positions: torch.Tensor, rope_lengths: torch.Tensor | None = None) -> Rotation:
        """rope_lengths: [tokens], each token's sequence length as needs_lengths says (None: position + 1)."""
        if not self.needs_lengths:
            return Rotation(positions, self.table, self.kernel)
        lengths = positions + 1 if rope_lengths is None else torch.maximum(rope_lengths, positions + 1)
        if self.kind == "longrope":
            return Rotation(positions + (lengths > self.original) * self.max_positions, self.table, self.kernel)
        frequencies = dynamic_ntk_inv_freq(self.rotary_dim, self.theta, self.scaling, lengths)
        table = _cos_sin_table(positions, frequencies, self.attention_factor)
        return Rotation(torch.arange(len(positions), device=positions.device), table, self.kernel)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
