"""Prepacked oneDNN linear layers against F.linear."""
import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.linear import Linear, can_prepack, padded_rows


@pytest.mark.skipif(not can_prepack(torch.bfloat16, torch.device("cpu")), reason="no fast bfloat16 here")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_bfloat16_linear_equals_f_linear(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, 80, generator=generator).bfloat16()
    layer = Linear(weight, bias)
    assert layer.prepacked
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=0, rtol=0)


def test_float32_keeps_the_exact_path():
    weight = torch.randn(8, 4)
    layer = Linear(weight)
    assert not layer.prepacked
    x = torch.randn(3, 4)
    assert torch.equal(layer(x), F.linear(x, weight))


def test_row_counts_are_padded_to_few_sizes():
    """oneDNN caches a primitive per shape, so the sizes it sees must stay few, and never shrink a batch."""
    sizes = {n: padded_rows(n) for n in range(1, 4097)}
    assert all(n <= padded < n + 256 for n, padded in sizes.items())
    assert all(padded - n < 8 for n, padded in sizes.items() if n <= 256)
    assert len(set(sizes.values())) == 32 + 12 + 12
