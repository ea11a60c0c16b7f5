"""Where the worker keeps swapped-out blocks of preempted requests (preemption_mode swap or auto): host RAM
(the --swap-space staging area) or the disk tier's directory, behind one small interface.

The scheduler's KV manager decides which blocks go out and come back (pagedllm/kv/swap.py keeps the room);
a copy is made in the step that swaps its request out, before the step can overwrite the block.
"""
from __future__ import annotations

import torch

from pagedllm.worker.kv_disk_store import DiskKVStore


class RamSwapSpace:
    """Copies in host memory, one per swapped block, until read back or dropped."""

    def __init__(self):
        self._blocks: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def save(self, key: int, payload: torch.Tensor) -> None:
        self._blocks[key] = payload

    def take(self, key: int) -> torch.Tensor | None:
        """The block's copy, given up; None when there is none."""
        return self._blocks.pop(key, None)

    def drop(self, key: int) -> None:
        self._blocks.pop(key, None)


class DiskSwapSpace:
    """Checksummed files in the disk tier's directory, written by its background writer."""

    def __init__(self, store: DiskKVStore):
        self.store = store

    def save(self, key: int, payload: torch.Tensor) -> None:
        self.store.write_swap(key, payload)

    def take(self, key: int) -> torch.Tensor | None:
        """The block's copy, its file deleted; None when it cannot be read."""
        return self.store.read_swap(key)

    def drop(self, key: int) -> None:
        self.store.delete_swap(key)
