"""One layer's LoRA update, the compiled lora_sgmv kernel and the torch path, against a plain per-row computation in
float64: rows of several adapters and of the base in any order, fused layers' parts, ranks 8/16/64, bfloat16 and
float32, and slots that leave the layer (or one of its parts) alone."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedllm.lora.punica import NO_SLOT, LoRASegments, PackedLoRA, StackedLoRA, add_lora_torch
from pagedllm.model import kernels

CPU = torch.device("cpu")


def kernel_update(out, x, step, stacked):
    kernels.kernels.lora_sgmv(out, x, stacked.a, stacked.b, stacked.ranks, stacked.column_starts, step.rows,
                              step.table)


IMPLEMENTATIONS = [pytest.param(kernel_update, id="kernel", marks=pytest.mark.kernels),
                   pytest.param(add_lora_torch, id="torch")]


def random_adapter(generator, ranks, in_features, columns, max_rank):
    """Each part's (A [rank, in], B [width, rank]) in float64 (None: rank 0), and the same as PackedLoRA lays it."""
    parts = [(torch.randn(rank, in_features, generator=generator, dtype=torch.float64) / in_features ** 0.5,
              torch.randn(width, rank, generator=generator, dtype=torch.float64) / rank ** 0.5) if rank else None
             for rank, width in zip(ranks, columns)]
    a = torch.zeros(len(columns) * max_rank, in_features, dtype=torch.float64)
    b = torch.zeros(max_rank, sum(columns), dtype=torch.float64)
    for part, (rank, start, width) in enumerate(zip(ranks, np.cumsum((0,) + columns), columns)):
        if rank:
            a[part * max_rank:part * max_rank + rank] = parts[part][0]
            b[:rank, start:start + width] = parts[part][1].t()
    return parts, PackedLoRA(a, b, torch.tensor(ranks, dtype=torch.int64))


def check_update(update, token_slots, adapter_ranks, in_features, columns, max_rank, dtype, lora_dtype, seed=0):
    """update (kernel or torch path) against out[row] += B_p (A_p x[row]) per part p of the row's adapter."""
    generator = torch.Generator().manual_seed(seed)
    stacked = StackedLoRA(len(adapter_ranks), max_rank, in_features, columns, lora_dtype, CPU)
    adapters = []
    for slot, ranks in enumerate(adapter_ranks):
        parts, packed = random_adapter(generator, ranks, in_features, columns, max_rank)
        stacked.set(slot, PackedLoRA(packed.a.to(lora_dtype), packed.b.to(lora_dtype), packed.ranks)
                    if any(ranks) else None)
        adapters.append([(a.to(lora_dtype).double(), b.to(lora_dtype).double()) if a is not None else None
                         for a, b in (part or (None, None) for part in parts)])
    x = torch.randn(len(token_slots), in_features, generator=generator).to(dtype)
    out = torch.randn(len(token_slots), sum(columns), generator=generator).to(dtype)
    expected = out.double()
    starts = np.cumsum((0,) + columns)
    for row, slot in enumerate(token_slots):
        if slot != NO_SLOT:
            for part, weights in enumerate(adapters[slot]):
                if weights is not None:
                    expected[row, starts[part]:starts[part + 1]] += weights[1] @ (weights[0] @ x[row].double())
    step = LoRASegments.of(np.array(token_slots, dtype=np.int64), CPU)
    assert step.count == len(set(token_slots) - {NO_SLOT})   # one segment per adapter, never per row
    update(out, x, step, stacked)
    # float32: summation order only; bfloat16: the inputs are exact, the update is rounded once into out (and the
    # torch path rounds the shrink's result too): a few bfloat16 ulps of the output's size.
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == lora_dtype == torch.float32 else dict(rtol=2e-2, atol=4e-2)
    torch.testing.assert_close(out.double(), expected, **tolerance)


@pytest.mark.parametrize("update", IMPLEMENTATIONS)
@settings(max_examples=40, deadline=None)
@given(token_slots=st.lists(st.sampled_from([NO_SLOT, 0, 1, 2, 3]), min_size=1, max_size=24),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), lora_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_mixed_rows_of_several_adapters_and_the_base(update, token_slots, dtype, lora_dtype):
    """Three parts (as q, k, v) of widths that are not whole vectors, an input width that is not either; slot 2
    leaves the layer alone and slot 3 one of its parts; ranks below max_rank, and not multiples of 4."""
    check_update(update, token_slots, [(8, 3, 5), (2, 8, 1), (0, 0, 0), (6, 0, 7)], 40, (24, 9, 31), 8, dtype,
                 lora_dtype)


@pytest.mark.parametrize("update", IMPLEMENTATIONS)
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("dtype, lora_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("sorted_rows", [True, False])
def test_ranks_and_model_sized_layers(update, rank, dtype, lora_dtype, sorted_rows):
    """Layer widths of a real model (several column blocks, two fused parts as gate and up), 37 rows: whole
    tiles of rows and a remainder, in order or shuffled among base rows."""
    generator = np.random.default_rng(rank)
    token_slots = [slot for slot in (0, 1, 2) for _ in range(11)] + [NO_SLOT] * 4
    if not sorted_rows:
        generator.shuffle(token_slots)
    check_update(update, token_slots, [(rank, rank), (rank, rank // 2), (rank // 4, rank)], 320, (576, 576), rank,
                 dtype, lora_dtype, seed=rank)


def test_a_step_of_the_base_alone_has_no_segments():
    step = LoRASegments.of(np.full(5, NO_SLOT, dtype=np.int64), CPU)
    assert step.count == 0 and step.rows.numel() == 0 and step.table.shape == (0, 3)


@pytest.mark.kernels
def test_the_kernel_refuses_a_segment_outside_the_slots():
    stacked = StackedLoRA(2, 8, 16, (16,), torch.float32, CPU)
    step = LoRASegments.of(np.array([0, 5], dtype=np.int64), CPU)
    with pytest.raises(RuntimeError, match="segment 1 \\(slot 5"):
        kernel_update(torch.zeros(2, 16), torch.zeros(2, 16), step, stacked)
