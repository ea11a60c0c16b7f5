"""The runner's attention layout of a step (ModelRunner.attention_metadata) against the layout written out by hand:
each new token's slot, the decode and prefill parts, the whole-step fields. A step of decodes only takes its own
shorter path, so it is checked on its own and beside a mixed step."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def runner(make_tiny_model_dir, tmp_path_factory):
    llm = LLM(str(make_tiny_model_dir(tmp_path_factory.mktemp("attention-layout"), "llama")), block_size=BLOCK_SIZE,
              enable_cascade_attention=False)
    return llm.llm_engine.executor.driver_worker.model_runner


def tables_for(context: list[int], num_new: list[int], spare: list[int]) -> np.ndarray:
    """Distinct block ids per row, as many as its tokens need plus `spare` more (a table may reach further than the
    step: blocks allocated ahead), padded with -1 to the widest row."""
    widths = [-(-(c + n) // BLOCK_SIZE) + s for c, n, s in zip(context, num_new, spare)]
    tables = np.full((len(context), max(widths)), -1, dtype=np.int64)
    next_block = 0
    for row, width in enumerate(widths):
        tables[row, :width] = np.arange(next_block, next_block + width)
        next_block += width
    return tables


def expected_layout(tables: np.ndarray, context: list[int], num_new: list[int]) -> dict:
    """The layout by its definition: tokens row by row, each at its row's next position; rows of up to 8 new tokens
    (all of them here) attend as decodes, one decode a token."""
    positions = [c + i for c, n in zip(context, num_new) for i in range(n)]
    token_rows = [row for row, n in enumerate(num_new) for _ in range(n)]
    decode_lens = [p + 1 for p in positions]
    width = -(-max(decode_lens) // BLOCK_SIZE)
    return {
        "positions": positions,
        "token_row": token_rows,
        "slot_mapping": [int(tables[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                         for r, p in zip(token_rows, positions)],
        "num_decode_tokens": len(positions),
        "decode_block_tables": tables[token_rows, :width].tolist(),
        "decode_seq_lens": decode_lens,
        "prefill_query_starts": [len(positions)],
        "prefill_context_lens": [],
        "prefill_block_tables_shape": (0, tables.shape[1]),
        "query_starts": np.concatenate(([0], np.cumsum(num_new))).tolist(),
        "seq_lens": [c + n for c, n in zip(context, num_new)],
        "block_tables": tables.tolist(),
        "max_query_len": max(num_new),
        "max_seq_len": max(c + n for c, n in zip(context, num_new)),
    }


def actual_layout(runner, tables: np.ndarray, context: list[int], num_new: list[int]) -> dict:
    meta, positions, token_row = runner.attention_metadata(tables, np.array(context, dtype=np.int64),
                                                           np.array(num_new, dtype=np.int64))
    fields = {name: getattr(meta, name).tolist() for name in (
        "slot_mapping", "decode_block_tables", "decode_seq_lens", "prefill_query_starts", "prefill_context_lens",
        "query_starts", "seq_lens", "block_tables")}
    for name in ("decode_block_tables", "decode_seq_lens", "slot_mapping", "block_tables"):
        assert getattr(meta, name).is_contiguous(), name   # the kernels take them as they are
    return {**fields, "positions": np.asarray(positions).tolist(), "token_row": np.asarray(token_row).tolist(),
            "num_decode_tokens": meta.num_decode_tokens, "max_query_len": meta.max_query_len,
            "max_seq_len": meta.max_seq_len, "prefill_block_tables_shape": tuple(meta.prefill_block_tables.shape)}


rows = st.lists(st.tuples(st.integers(0, 80), st.integers(0, 2)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(rows=rows)
def test_a_step_of_decodes_only_has_the_layout_of_its_definition(runner, rows):
    context, spare = [c for c, _ in rows], [s for _, s in rows]
    num_new = [1] * len(rows)
    tables = tables_for(context, num_new, spare)
    assert actual_layout(runner, tables, context, num_new) == expected_layout(tables, context, num_new)


@settings(max_examples=60, deadline=None)
@given(rows=rows, extra=st.integers(1, 7), at=st.integers(0, 5))
def test_a_step_with_a_longer_row_has_the_layout_of_its_definition(runner, rows, extra, at):
    """One row of 2..8 new tokens (a speculative verification's or a short chunk's) among decodes: the general path."""
    context, spare = [c for c, _ in rows], [s for _, s in rows]
    num_new = [1] * len(rows)
    num_new[at % len(rows)] += extra
    tables = tables_for(context, num_new, spare)
    assert actual_layout(runner, tables, context, num_new) == expected_layout(tables, context, num_new)


def test_the_decode_tables_are_cut_to_the_keys_the_step_reads(runner):
    """Rows whose tables reach two blocks past their keys: the decode tables stop at the longest row's keys."""
    context, num_new = [13, 4], [1, 1]
    tables = tables_for(context, num_new, [2, 2])
    meta, _, _ = runner.attention_metadata(tables, np.array(context), np.array(num_new))
    assert meta.block_tables.shape == (2, 4) and meta.decode_block_tables.shape == (2, 2)
    assert torch.equal(meta.decode_block_tables, torch.from_numpy(tables[:, :2]))
