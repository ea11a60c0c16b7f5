"""The quantized weights moved into one huge-page buffer (pagedllm/model/weight_placement.py).

Moving bytes must change nothing the kernels compute: each layer's output is asserted bitwise equal before and
after, and every weight part equal to its source. The placement itself is observed from outside: the tensors
share one storage, start 2 MiB-aligned and 64-byte aligned, a tied tensor stays one tensor, and the kernel's
record of the mapping (/proc/self/smaps: VmFlags `hg`, set by madvise(MADV_HUGEPAGE), and THPeligible) says
the advice was applied, and the memory can take huge pages, where the THP setting allows it; not where refused.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pagedllm.model.linear import QuantizedLinear
from pagedllm.model.quantization import quantize
from pagedllm.model.weight_placement import HUGE_PAGE_BYTES, place_on_huge_pages, thp_setting

pytestmark = pytest.mark.kernels


def mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields (VmFlags, THPeligible, AnonHugePages, ...) of the mapping that holds address."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if head.endswith(":"):
            if inside:
                fields[head[:-1]] = rest.strip()
        elif inside:
            break
        else:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
    assert fields, f"no mapping holds {address:#x}"
    return fields


class TinyModel(nn.Module):
    """Two decoder-layer projections and a head tied to an embedding table, as CausalLM names them."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        weight = lambda rows, cols: torch.randn(rows, cols, generator=generator) * 0.05
        head = quantize(weight(4100, 512), 8)   # 2.1 MB of int8: the buffer spans a whole 2 MiB page
        self.lm_head = QuantizedLinear(head)
        self.table = QuantizedLinear(head)   # tied: the same tensors as the head
        self.layers = nn.ModuleList([QuantizedLinear(quantize(weight(80, 64), 4)),
                                     QuantizedLinear(quantize(weight(64, 160), 4))])


def outputs(model: TinyModel, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    layers = [*model.layers, model.lm_head]
    return [layer(torch.randn(3, layer.in_features, generator=generator).to(dtype)) for layer in layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moved_weights_compute_the_same(dtype):
    model = TinyModel()
    sources = {name: tensor.clone() for name, tensor in model.named_buffers() if tensor is not None}
    before = outputs(model, dtype)
    placement = place_on_huge_pages(model)
    after = outputs(model, dtype)
    for old, new in zip(before, after):
        assert torch.equal(old, new)
    for name, tensor in model.named_buffers():
        if name in sources:
            assert torch.equal(tensor, sources[name]) and tensor.dtype == sources[name].dtype
    parts = [getattr(m, p) for m in model.modules() if isinstance(m, QuantizedLinear)
             for p in ("qweight", "scales", "mins") if getattr(m, p) is not None]
    assert len({t.untyped_storage().data_ptr() for t in parts}) == 1
    assert all(t.data_ptr() % 64 == 0 for t in parts)
    assert min(t.data_ptr() for t in parts) % HUGE_PAGE_BYTES == 0
    assert model.table.qweight is model.lm_head.qweight and model.table.scales is model.lm_head.scales
    held = {t.data_ptr(): t.nbytes for t in parts}   # the tied head counted once
    assert sum(-(-n // 64) * 64 for n in held.values()) == placement.num_bytes == parts[0].untyped_storage().nbytes()


def test_decoder_layers_come_first():
    model = TinyModel()
    place_on_huge_pages(model)
    starts = [m.qweight.data_ptr() for m in (*model.layers, model.lm_head)]
    assert starts == sorted(starts)


@pytest.mark.skipif(thp_setting() not in ("always", "madvise"),
                    reason=f"transparent huge pages are {thp_setting()} here: no advice to observe")
def test_advice_is_applied():
    model = TinyModel()
    placement = place_on_huge_pages(model)
    assert placement.advised and "huge pages" in placement.describe()
    fields = mapping_fields(model.lm_head.qweight.data_ptr())
    assert "hg" in fields["VmFlags"].split()
    if "THPeligible" in fields:   # the kernel's own verdict: private anonymous memory advised for THP
        assert fields["THPeligible"] == "1"


def test_refused_setting_gives_no_advice():
    model = TinyModel()
    placement = place_on_huge_pages(model, setting="never")
    assert not placement.advised and "never" in placement.reason
    assert "hg" not in mapping_fields(model.lm_head.qweight.data_ptr())["VmFlags"].split()


def test_nothing_to_place():
    assert place_on_huge_pages(nn.Linear(4, 4)) is None
