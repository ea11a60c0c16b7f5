"""Packed token bitmasks on logits: the CPU kernel and the torch path against xgrammar's own mask, and
allowed_token_ids packed into the same form."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xgrammar as xgr

from pagedllm.worker import token_bitmask
from pagedllm.worker.token_bitmask import apply_token_bitmask, apply_token_bitmask_torch, pack_allowed, stack_bitmasks


def random_bitmask(rows: int, vocab: int, seed: int) -> np.ndarray:
    """Words of every kind a grammar gives: all allowed, none allowed, and mixed."""
    rng = np.random.default_rng(seed)
    words = rng.integers(-2**31, 2**31, (rows, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    kinds = rng.integers(0, 3, words.shape)
    words[kinds == 0] = 0
    words[kinds == 1] = -1
    return words


def xgrammar_reference(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """xgrammar's CPU mask, on a bitmask aligned with the logits (other rows allow everything)."""
    expected = logits.clone()
    aligned = np.full((len(logits), bitmask.shape[1]), -1, np.int32)
    aligned[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, torch.from_numpy(aligned), vocab_size=logits.shape[1])
    return expected


@pytest.mark.kernels
@pytest.mark.parametrize("vocab", [32, 49152, 1003])
@pytest.mark.parametrize("apply", [apply_token_bitmask, apply_token_bitmask_torch], ids=["kernel", "torch"])
def test_masks_the_named_rows_as_xgrammar_does(vocab, apply):
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab))
    rows = [5, 0, 3]
    bitmask = random_bitmask(len(rows), vocab, vocab)
    if vocab % 32:   # bits past the vocabulary in the last word are never read
        bitmask[:, -1] |= np.int32(-1 << (vocab % 32))
    masked = logits.clone()
    apply(masked, torch.from_numpy(bitmask), torch.tensor(rows))
    torch.testing.assert_close(masked, xgrammar_reference(logits, bitmask, rows), rtol=0, atol=0)
    untouched = [row for row in range(len(logits)) if row not in rows]
    assert torch.equal(masked[untouched], logits[untouched])


@pytest.mark.kernels
def test_the_cpu_kernel_serves_where_it_is_built():
    assert token_bitmask._CPU_KERNEL is not None


def test_a_packed_allowed_list_allows_exactly_its_tokens():
    vocab, allowed = 100, np.array([0, 31, 32, 63, 64, 70])
    stacked = stack_bitmasks([pack_allowed(allowed), pack_allowed(np.array([99]))], vocab)
    assert stacked.shape == (2, 4)
    logits = torch.zeros(3, vocab)
    apply_token_bitmask(logits, stacked, torch.tensor([0, 2]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == allowed.tolist()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [99]
    assert torch.isfinite(logits[1]).all()
    assert (logits[0, 1:31] == -math.inf).all()


def test_bad_arguments_name_what_is_wrong():
    if token_bitmask._CPU_KERNEL is None:
        pytest.skip("the C++ kernels are not built")
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="logits row 2 outside"):
        apply_token_bitmask(logits, np.zeros((1, 2), np.int32), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="bitmask has 1 words, the vocabulary needs 2"):
        apply_token_bitmask(logits, np.zeros((1, 1), np.int32), torch.tensor([0]))
