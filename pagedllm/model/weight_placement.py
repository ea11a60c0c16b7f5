"""A model's quantized weights moved into one buffer on transparent huge pages, in the order a decode step reads them.

Batch-1 decode streams every weight from memory once a token (96 MB for the bundled model). On 4 KiB pages that
is ~24,000 pages a token, each a TLB miss and a page walk, and the hardware prefetchers stop at every page's end;
and no single weight (the largest projection is 0.9 MB) is big enough for a 2 MiB page of its own. One buffer,
2 MiB-aligned and advised MADV_HUGEPAGE before it is written, is backed by 2 MiB pages wherever
/sys/kernel/mm/transparent_hugepage/enabled says `always` or `madvise`. Only where the bytes live changes: each
weight keeps its shape, dtype and values, and tied weights (the embedding and the LM head) stay one tensor.
"""
from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagedllm.model.linear import QuantizedLinear

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 2**20
ALIGN_BYTES = 64   # each weight starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
QUANTIZED_PARTS = ("qweight", "scales", "mins")


def thp_setting() -> str:
    """The kernel's transparent huge page mode (always, madvise, never), or 'unavailable'."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


@dataclass(frozen=True)
class Placement:
    """Where the quantized weights went: bytes moved, and whether huge pages were asked for (why not, if not)."""
    num_bytes: int
    advised: bool
    reason: str

    def describe(self) -> str:
        where = "one buffer on huge pages (MADV_HUGEPAGE)" if self.advised else f"one buffer, 4 KiB pages ({self.reason})"
        return f"quantized weights {self.num_bytes / 2**20:.1f} MiB in {where}"


def huge_page_buffer(num_bytes: int, setting: str) -> tuple[torch.Tensor, bool, str]:
    """(uint8 tensor of num_bytes starting on a 2 MiB boundary, whether MADV_HUGEPAGE was applied, why not).
    setting: thp_setting()'s answer. The anonymous mapping is advised before any byte is written, so the first
    touch faults in huge pages."""
    # private: a shared anonymous mapping is shmem, which THP serves only under shmem_enabled (often never)
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advised, reason = False, f"transparent huge pages are {setting}"
    if setting in ("always", "madvise"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
            advised, reason = True, ""
        except (OSError, AttributeError) as error:   # AttributeError: a platform without MADV_HUGEPAGE
            reason = f"madvise(MADV_HUGEPAGE) failed: {error}"
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE_BYTES
    # a storage of exactly num_bytes (the model's weight_bytes counts storages); it holds a reference to the mapping
    return torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes, offset=start), advised, reason


def quantized_tensors(model: nn.Module) -> list[tuple[QuantizedLinear, str, torch.Tensor]]:
    """(layer, buffer name, tensor) of every quantized layer's weight parts: the decoder layers' first, in
    their order (a decode step's), then the rest (the LM head, the embedding table)."""
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, QuantizedLinear)]
    layers.sort(key=lambda item: not item[0].startswith("layers."))   # stable: the order within each kind stays
    return [(module, part, getattr(module, part)) for _, module in layers for part in QUANTIZED_PARTS
            if getattr(module, part) is not None]


def place_on_huge_pages(model: nn.Module, setting: str | None = None) -> Placement | None:
    """Moves the model's quantized CPU weights into one huge-page buffer (see the module docstring); None where
    there are none. A tensor shared by two layers (a tied embedding) is moved once and stays shared.
    setting: the THP mode to act on (default: the kernel's, thp_setting())."""
    parts = [(module, name, tensor) for module, name, tensor in quantized_tensors(model)
             if tensor.device.type == "cpu"]
    if not parts:
        return None
    offsets: dict[int, int] = {}   # a source tensor's id -> its offset in the buffer
    end = 0
    for _, _, tensor in parts:
        if id(tensor) not in offsets:
            offsets[id(tensor)] = end
            end += -(-tensor.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    buffer, advised, reason = huge_page_buffer(end, setting or thp_setting())
    moved: dict[int, torch.Tensor] = {}
    for module, name, tensor in parts:
        if id(tensor) not in moved:
            start = offsets[id(tensor)]
            placed = buffer[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            moved[id(tensor)] = placed.copy_(tensor)
        setattr(module, name, moved[id(tensor)])
    placement = Placement(end, advised, reason)
    logger.info("%s", placement.describe())
    return placement
