"""Shared-prefix (cascade) attention: which of a step's sequences share leading KV blocks, and how far.

Parallel samples, beams and requests that hit the prefix cache for one system prompt point their block
tables at the same physical blocks for their common prefix. Paging makes that visible for free: equal
leading block ids mean the same keys and values in the same memory. The cascade kernel
(csrc/cascade_attention.cpp) reads such a group's shared blocks once for all its query rows, then each
sequence's own blocks, and merges the two softmaxes; this module finds the groups from the tables the
runner already holds, with array comparisons only.

The shared length of a group is exact: the leading blocks on which every member's table agrees,
cut to the smallest cached context among the members (the keys before every member's first query
row). Slots past that may differ between members, or be written in this very step, so the prefix
ends mid-block where the contexts do; the slots before it are never written in the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Smaller groups are left to the plain kernels: the cascade's second pass and merge cost more than
# the reads it saves (`pagedllm bench cascade`, docs/kv-cache.md, "Shared-prefix (cascade) attention"): 4 and 8
# sequences break even at ~128 shared keys, 64 at ~64; pairs did not pay at any length up to 1024.
MIN_SHARED_TOKENS = 128
MIN_GROUP_SIZE = 4


@dataclass(frozen=True)
class SharedPrefixGroups:
    """Groups of a step part's sequences (rows of its block tables) that share a prefix, as the kernel
    takes them: group g is group_seqs[group_starts[g]:group_starts[g + 1]], sharing shared_lens[g] keys."""
    group_seqs: torch.Tensor     # int64
    group_starts: torch.Tensor   # [groups + 1] int64
    shared_lens: torch.Tensor    # [groups] int64


def find_shared_prefixes(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int,
                         min_shared_tokens: int = MIN_SHARED_TOKENS,
                         min_group_size: int = MIN_GROUP_SIZE) -> SharedPrefixGroups | None:
    """block_tables: [seqs, blocks] int64, each row valid over its sequence's blocks; context_lens: [seqs],
    the keys cached before each sequence's first query row. Sequences are grouped by their first block
    id; a group of at least min_group_size (>= 2) sharing at least min_shared_tokens keys is kept.
    None when none is."""
    if len(context_lens) < min_group_size or block_tables.shape[1] == 0:
        return None
    order = np.argsort(block_tables[:, 0], kind="stable")
    first_blocks = block_tables[order, 0]
    bounds = np.concatenate(([0], np.flatnonzero(first_blocks[1:] != first_blocks[:-1]) + 1, [len(order)]))
    members, starts, shared_lens = [], [0], []
    for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if end - begin < min_group_size:
            continue
        group = order[begin:end]
        tables = block_tables[group]
        agree = (tables == tables[0]).all(axis=0)
        common_blocks = len(agree) if agree.all() else int(np.argmin(agree))
        shared = min(common_blocks * block_size, int(context_lens[group].min()))
        if shared >= min_shared_tokens:
            members.append(group)
            starts.append(starts[-1] + len(group))
            shared_lens.append(shared)
    if not shared_lens:
        return None
    return SharedPrefixGroups(torch.from_numpy(np.concatenate(members).astype(np.int64)),
                              torch.tensor(starts, dtype=torch.int64), torch.tensor(shared_lens, dtype=torch.int64))
