"""Step inputs from numpy to the device: on CUDA through pinned host buffers with non-blocking copies.

A copy from pageable memory makes the host wait for the GPU; from pinned memory it is queued on the
stream and the host goes on preparing. Each named input has its own buffer, grown when a step needs more,
so no two inputs of one step share memory. Before a buffer is written again the host waits for its last
copy to have run (an event): normally long done, since the runner waited for the previous step's sampled
ids; after a step that sampled nothing, the wait keeps the host from overwriting what the GPU still reads.
"""
from __future__ import annotations

import numpy as np
import torch


class HostStaging:
    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffers: dict[str, torch.Tensor] = {}
        self.copied: dict[str, torch.cuda.Event] = {}   # each buffer's last copy

    def to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """array on the device. On CPU the tensor shares array's memory (no copy)."""
        source = torch.from_numpy(np.ascontiguousarray(array))
        if not self.pinned:
            return source.to(self.device)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < source.numel() or buffer.dtype != source.dtype:
            buffer = torch.empty(max(source.numel(), 2 * (0 if buffer is None else buffer.numel())),
                                 dtype=source.dtype, pin_memory=True)
            self.buffers[name] = buffer
        elif name in self.copied:
            self.copied[name].synchronize()
        staged = buffer[:source.numel()].view(source.shape)
        staged.copy_(source)
        on_device = staged.to(self.device, non_blocking=True)
        self.copied.setdefault(name, torch.cuda.Event()).record()
        return on_device


def fetch(tensors: list[torch.Tensor | None]) -> list[list | None]:
    """Device tensors as Python lists with one wait for the device, however many there are (the step's
    only synchronisation: the sampled ids and what comes with them)."""
    on_device = [t for t in tensors if t is not None and t.device.type == "cuda"]
    if on_device:
        host = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.current_stream(on_device[0].device).synchronize()
        tensors = host
    return [None if t is None else t.tolist() for t in tensors]
