"""The step's token rows grouped by adapter slot (Punica / S-LoRA's SGMV layout), computed once per step, and each
LoRA layer's adapters stacked by slot, so that one call updates a layer for every row of the step.

The update is x @ A @ B added to the base's output, never merged into the base weights (the base stays quantized).
The compiled `lora_sgmv` runs it (shrink and expand per segment of rows sharing an adapter, all in one call);
`add_lora_torch` is the same update in torch ops, where no compiled kernel serves.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NO_SLOT = -1   # a row of the base model


@dataclass(frozen=True)
class LoRASegments:
    """rows[start:end] are the step's token rows of segment (slot, start, end) of `table`; base rows are in none."""
    rows: torch.Tensor    # int64 [rows with an adapter], grouped by slot, in step order within a slot
    table: torch.Tensor   # int64 [segments, 3]: slot, start, end
    count: int            # segments (0: a step of the base alone, no layer does LoRA work)

    @classmethod
    def of(cls, token_slots: np.ndarray, device: torch.device) -> LoRASegments:
        """One segment per slot in the step (a stable sort: rows of one adapter need not be next to each other)."""
        rows = np.flatnonzero(token_slots != NO_SLOT)
        rows = rows[np.argsort(token_slots[rows], kind="stable")]
        slots = token_slots[rows]
        starts = np.flatnonzero(np.diff(slots, prepend=NO_SLOT - 1))
        ends = np.append(starts[1:], len(rows))[:len(starts)]
        table = np.stack([slots[starts], starts, ends], axis=1).astype(np.int64)
        return cls(torch.from_numpy(rows.astype(np.int64)).to(device), torch.from_numpy(table).to(device), len(starts))

    @classmethod
    def none(cls) -> LoRASegments:
        return cls.of(np.zeros(0, np.int64), torch.device("cpu"))


@dataclass(frozen=True)
class PackedLoRA:
    """One adapter's update of one (possibly fused) layer, laid out as a slot of StackedLoRA holds it: the parts' A
    (q, k, v of the fused qkv layer; gate, up of gate_up) each in its own max_rank rows of `a`, and `b` giving every
    output column the B row of the part that owns it, so the expand reads only that part's rank."""
    a: torch.Tensor       # [parts * max_rank, in_features]
    b: torch.Tensor       # [max_rank, out_features]
    ranks: torch.Tensor   # int64 [parts]: each part's rank, 0 where the adapter leaves the part alone


class StackedLoRA:
    """Every slot's PackedLoRA of one layer in tensors [max_loras, ...]: the kernel takes tensors only, and a
    slot with nothing for this layer (ranks 0) costs nothing."""

    def __init__(self, max_loras: int, max_rank: int, in_features: int, columns: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        self.a = torch.zeros(max_loras, len(columns) * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, max_rank, sum(columns), dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, len(columns), dtype=torch.int64, device=device)
        self.column_starts = torch.tensor(np.cumsum((0,) + columns), dtype=torch.int64, device=device)

    def set(self, slot: int, packed: PackedLoRA | None) -> None:
        """Copies the adapter's update into the slot; None: the slot does nothing for this layer."""
        if packed is None:
            self.ranks[slot] = 0
            return
        self.a[slot].copy_(packed.a)
        self.b[slot].copy_(packed.b)
        self.ranks[slot].copy_(packed.ranks)


def add_lora_torch(out: torch.Tensor, x: torch.Tensor, step: LoRASegments, stacked: StackedLoRA) -> None:
    """out += each row's adapter update, in torch ops: per segment and part, one shrink and one expand matmul."""
    max_rank = stacked.b.shape[1]
    starts = stacked.column_starts.tolist()
    for slot, start, end in step.table.tolist():
        rows = step.rows[start:end]
        inputs = x.index_select(0, rows).to(stacked.a.dtype)
        update = torch.zeros(end - start, out.shape[1], dtype=stacked.a.dtype, device=out.device)
        for part, rank in enumerate(stacked.ranks[slot].tolist()):
            if rank:
                first = part * max_rank
                shrunk = inputs @ stacked.a[slot, first:first + rank].t()
                columns = slice(starts[part], starts[part + 1])
                update[:, columns] = shrunk @ stacked.b[slot, :rank, columns]
        out.index_add_(0, rows, update.to(out.dtype))
