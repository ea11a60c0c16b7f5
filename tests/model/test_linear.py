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


@pytest.mark.skipif(not can_prepack(torch.float32, torch.device("cpu")), reason="no oneDNN here")
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_float32_rows_match_f_linear_and_do_not_depend_on_their_batch(with_bias):
    """A speculative verification (1 + k rows) must cost about one row and give each row what a one-row decode
    step gives it: for 1..9 rows, against F.linear in float64 (the reference, within float32 rounding of a
    80-term dot product), and each row bitwise equal to that row alone."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    layer = Linear(weight, bias)
    assert layer.prepacked
    for rows in range(1, 10):
        x = torch.randn(rows, 80, generator=generator)
        out = layer(x)
        reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-5)
        for row in range(rows):
            assert torch.equal(out[row], layer(x[row:row + 1])[0]), (rows, row)


def test_row_counts_are_padded_to_few_sizes():
    """oneDNN caches a primitive per shape, so the sizes it sees must stay few, and never shrink a batch."""
    sizes = {n: padded_rows(n) for n in range(1, 4097)}
    assert all(n <= padded < n + 256 for n, padded in sizes.items())
    assert all(padded - n < 8 for n, padded in sizes.items() if n <= 256)
    assert len(set(sizes.values())) == 32 + 12 + 12
