"""The grouped (SGMV) update against a per-row reference: rows of several adapters and of the base, in any order."""
import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from pagedllm.lora.punica import NO_SLOT, LoRASegments, PackedLoRA, add_lora

IN, OUT = 12, 10
COLUMNS = ((0, 4), (4, 10))   # two parts of a fused layer, as q and kv


def packed(seed: int, ranks: tuple[int, int]) -> tuple[PackedLoRA, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A two-part adapter as LoRAModel.pack lays it out, and its parts' (A, B) for the reference."""
    generator = torch.Generator().manual_seed(seed)
    parts = []
    a_t, b_t = torch.zeros(IN, sum(ranks), dtype=torch.float64), torch.zeros(sum(ranks), OUT, dtype=torch.float64)
    start = 0
    for (column_start, column_end), rank in zip(COLUMNS, ranks):
        a = torch.randn(rank, IN, generator=generator, dtype=torch.float64)
        b = torch.randn(column_end - column_start, rank, generator=generator, dtype=torch.float64)
        parts.append((a, b))
        a_t[:, start:start + rank], b_t[start:start + rank, column_start:column_end] = a.t(), b.t()
        start += rank
    return PackedLoRA(a_t, b_t), parts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([NO_SLOT, 0, 1, 2]), min_size=1, max_size=24))
def test_grouped_update_equals_each_row_with_its_own_adapter(token_slots):
    adapters = [packed(seed, ranks) for seed, ranks in enumerate([(2, 3), (4, 1), (1, 1)])]
    slots = [adapter for adapter, _ in adapters]
    x = torch.randn(len(token_slots), IN, dtype=torch.float64)
    out = torch.randn(len(token_slots), OUT, dtype=torch.float64)
    expected = out.clone()
    for row, slot in enumerate(token_slots):
        if slot != NO_SLOT:
            for (column_start, column_end), (a, b) in zip(COLUMNS, adapters[slot][1]):
                expected[row, column_start:column_end] += b @ (a @ x[row])
    step = LoRASegments.of(np.array(token_slots), torch.device("cpu"))
    assert len(step.segments) == len(set(token_slots) - {NO_SLOT})   # one segment per adapter, never per row
    add_lora(out, x, step, slots)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
