"""The step's token rows grouped by adapter slot (Punica / S-LoRA's SGMV layout), computed once per step.

Each LoRA layer then runs one shrink (x @ A) and one expand (@ B) per segment of rows that share an adapter,
never one row at a time, and never by merging an adapter into the base weights (the base stays quantized).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

NO_SLOT = -1   # a row of the base model


@dataclass
class LoRASegments:
    """segments: (slot, start, end) over the rows in `order`; order None: the rows are grouped already, in place."""
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    order: torch.Tensor | None = None

    @classmethod
    def of(cls, token_slots: np.ndarray, device: torch.device) -> LoRASegments:
        """Groups tokens by slot (NO_SLOT rows are left out): by their place when each slot's rows are one run
        already (the common case: one adapter, or requests of one adapter next to each other), else by a stable sort."""
        if not len(token_slots) or (token_slots == NO_SLOT).all():
            return cls()
        runs = _runs(token_slots)
        if len({slot for slot, _, _ in runs}) == len(runs):
            return cls(runs)
        order = np.argsort(token_slots, kind="stable")
        return cls(_runs(token_slots[order]), torch.from_numpy(order).to(device))


def _runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(slot, start, end) of each run of equal slots, base rows left out."""
    changes = np.flatnonzero(np.diff(slots)) + 1
    starts, ends = np.concatenate([[0], changes]), np.concatenate([changes, [len(slots)]])
    return [(int(slots[start]), int(start), int(end)) for start, end in zip(starts, ends) if slots[start] != NO_SLOT]


@dataclass(frozen=True)
class PackedLoRA:
    """One adapter's update of one (possibly fused) layer in two matmuls: the parts' A stacked into one shrink, and
    their B placed block-diagonally into one expand, each part's block writing its own output columns (q, k, v of
    the fused qkv layer; gate, up of gate_up). One expand instead of one per part: on CPUs a step's cost at small
    batches is the count of small matmuls, not their few extra zero multiplications."""
    a_t: torch.Tensor   # [in_features, total rank]
    b_t: torch.Tensor   # [total rank, out_features], zero outside each part's rows and columns


def add_lora(out: torch.Tensor, x: torch.Tensor, step: LoRASegments, slots: list[PackedLoRA | None]) -> None:
    """out += each row's adapter update: one shrink and one expand matmul per segment of rows (SGMV)."""
    gathered = x if step.order is None else x.index_select(0, step.order)
    for slot, start, end in step.segments:
        packed = slots[slot]
        if packed is None:   # the adapter leaves this layer alone
            continue
        shrunk = gathered[start:end].to(packed.a_t.dtype) @ packed.a_t
        if step.order is not None:
            out.index_add_(0, step.order[start:end], (shrunk @ packed.b_t).to(out.dtype))
        elif out.dtype == shrunk.dtype:
            out[start:end].addmm_(shrunk, packed.b_t)
        else:
            out[start:end] += (shrunk @ packed.b_t).to(out.dtype)
