"""Shared-prefix (cascade) attention: which of a step's sequences share leading KV blocks, and how far.

Parallel samples, beams and requests that hit the prefix cache for one system prompt point their block
tables at the same physical blocks for their common prefix. Paging makes that visible for free: equal
leading block ids mean the same keys and values in the same memory. The cascade kernel
(csrc/cascade_attention.cpp) reads such a group's shared blocks once for all its query rows, then each
sequence's own blocks, and merges the two softmaxes; this module finds the groups from the tables the
runner already holds, with array comparisons only.

Which groups are worth it depends on the machine (the cascade's second pass and merge cost more than the reads
it saves for small groups and short prefixes): a CascadeRule, reduced from timings of the two kernels
(model/cascade_timing.py, at start-up), gives the least shared length per group size.

The shared length of a group is exact: the leading blocks on which every member's table agrees,
cut to the smallest cached context among the members (the keys before every member's first query
row). Slots past that may differ between members, or be written in this very step, so the prefix
ends mid-block where the contexts do; the slots before it are never written in the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# A point of the start-up timing counts as a win for the cascade when it takes at least this much less time
# than the plain kernel: the group search costs a little every step, and a break-even point is within the noise.
MIN_SPEED_UP = 1.05


@dataclass(frozen=True)
class CascadeTiming:
    """One measured point: a group of group_size decodes sharing shared_len keys, each kernel's best time."""
    group_size: int
    shared_len: int
    plain_seconds: float
    cascade_seconds: float

    @property
    def speed_up(self) -> float:
        return self.plain_seconds / self.cascade_seconds

    @property
    def wins(self) -> bool:
        return self.speed_up >= MIN_SPEED_UP


@dataclass(frozen=True)
class CascadeRule:
    """When a group goes to the cascade kernel: thresholds holds (group size, least shared keys or None: it never
    paid at that size), by group size ascending. A group of n sequences needs the least threshold among the
    sizes <= n: a larger group gains more from the same shared keys (each is read once for more rows), so a
    noisy loss measured at a large size does not undo a smaller size's win. Below the smallest size: not kept."""
    thresholds: tuple[tuple[int, int | None], ...]

    def __post_init__(self) -> None:
        sizes = [size for size, _ in self.thresholds]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 2:
            raise ValueError(f"CascadeRule thresholds need distinct group sizes >= 2 in ascending order, got {sizes}")

    def min_shared_len(self, group_size: int) -> int | None:
        """The least shared keys a group of group_size needs to be kept (None: never kept)."""
        kept = [least for size, least in self.thresholds if size <= group_size and least is not None]
        return min(kept, default=None)

    @property
    def smallest_group(self) -> int | None:
        """The fewest sequences any group needs (None: the rule keeps nothing)."""
        return next((size for size, least in self.thresholds if least is not None), None)

    def describe(self) -> str:
        """The sizes where the least shared length needed drops, as the per-step decision reads them."""
        steps, previous = [], None
        for size, _ in self.thresholds:
            least = self.min_shared_len(size)
            if least is not None and least != previous:
                steps.append(f"{size}+ sequences from {least} shared keys")
                previous = least
        return "; ".join(steps) if steps else "no group pays"


# enable_cascade_attention=True: every group of two or more sequences sharing any keys.
ALWAYS = CascadeRule(((2, 1),))


def rule_from_timings(timings: list[CascadeTiming]) -> CascadeRule:
    """Per measured group size, the least measured shared length from which the cascade wins at every longer
    one measured (a win below a loss is noise, not a threshold); None where it loses at the longest."""
    by_size: dict[int, list[CascadeTiming]] = {}
    for timing in timings:
        by_size.setdefault(timing.group_size, []).append(timing)
    thresholds = []
    for size in sorted(by_size):
        least = None
        for timing in sorted(by_size[size], key=lambda t: t.shared_len, reverse=True):
            if not timing.wins:
                break
            least = timing.shared_len
        thresholds.append((size, least))
    return CascadeRule(tuple(thresholds))


@dataclass(frozen=True)
class SharedPrefixGroups:
    """Groups of a step part's sequences (rows of its block tables) that share a prefix, as the kernel
    takes them: group g is group_seqs[group_starts[g]:group_starts[g + 1]], sharing shared_lens[g] keys."""
    group_seqs: torch.Tensor     # int64
    group_starts: torch.Tensor   # [groups + 1] int64
    shared_lens: torch.Tensor    # [groups] int64


def find_shared_prefixes(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int,
                         rule: CascadeRule) -> SharedPrefixGroups | None:
    """block_tables: [seqs, blocks] int64, each row valid over its sequence's blocks; context_lens: [seqs],
    the keys cached before each sequence's first query row. Sequences are grouped by their first block
    id; a group is kept where the rule says its size and shared length pay. None when none is."""
    smallest = rule.smallest_group
    if smallest is None or len(context_lens) < smallest or block_tables.shape[1] == 0:
        return None
    order = np.argsort(block_tables[:, 0], kind="stable")
    first_blocks = block_tables[order, 0]
    bounds = np.concatenate(([0], np.flatnonzero(first_blocks[1:] != first_blocks[:-1]) + 1, [len(order)]))
    members, starts, shared_lens = [], [0], []
    large_enough = np.diff(bounds) >= smallest   # most steps' groups are single sequences: skip them as arrays
    for begin, end in zip(bounds[:-1][large_enough].tolist(), bounds[1:][large_enough].tolist()):
        least = rule.min_shared_len(end - begin)
        if least is None:
            continue
        group = order[begin:end]
        tables = block_tables[group]
        agree = (tables == tables[0]).all(axis=0)
        common_blocks = len(agree) if agree.all() else int(np.argmin(agree))
        shared = min(common_blocks * block_size, int(context_lens[group].min()))
        if shared >= least:
            members.append(group)
            starts.append(starts[-1] + len(group))
            shared_lens.append(shared)
    if not shared_lens:
        return None
    return SharedPrefixGroups(torch.from_numpy(np.concatenate(members).astype(np.int64)),
                              torch.tensor(starts, dtype=torch.int64), torch.tensor(shared_lens, dtype=torch.int64))
