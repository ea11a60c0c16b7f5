"""Timing the cascade kernel against the plain decode kernel on the CPU at hand, for the rule that decides per step
which shared-prefix groups go to the cascade (model/cascade.py's CascadeRule).

Where the cascade pays depends on the machine: its second pass and merge cost more than the reads it saves for
small groups and short prefixes, and how much more depends on the cores, the threads and the cache sizes (idle
on 2 EPYC cores, 4 sequences won from 256 shared keys with one thread and lost even at 1,024 with two). So the
engine times a few points at start-up, in one layer of its own attention shape, KV dtype and thread count; and
`pagedllm bench cascade` prints the same timings over any grid.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedllm.model.attention.cache import has_scales, kv_cache_shapes, kv_scales_shape, quantize
from pagedllm.model.cascade import ALWAYS, CascadeRule, CascadeTiming, find_shared_prefixes, rule_from_timings

# The start-up grid: group sizes from a pair to a large batch, shared lengths from a few blocks to a long system
# prompt. Longer prefixes and larger groups follow the longest and largest entries (the cascade gains with both);
# a size between two entries follows the smaller one's, so the steps are no coarser than doubling (without 32,
# the 62 sequences of 64 requests that hit one cached prompt followed 16's "never" on Ice Lake).
STARTUP_GROUP_SIZES = (2, 4, 8, 16, 32, 64)
STARTUP_SHARED_LENS = (64, 128, 256, 512, 1024)
STARTUP_REPS = 5       # best of 5 calls per kernel and point
# Idle, the grid takes a few tenths of a second; on a loaded machine every call waits for descheduled threads, and
# the timing stops here: the sizes not reached follow the smaller ones' thresholds (CascadeRule).
STARTUP_BUDGET_SECONDS = 0.5
OWN_LEN = 20           # keys of each decode's own after the shared ones


@dataclass(frozen=True)
class AttentionShape:
    """What the kernels' speed depends on, as one rank of the engine runs them."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype            # the queries'
    kv_cache_dtype: torch.dtype
    block_size: int


@dataclass(frozen=True)
class CascadeMeasurement:
    """The start-up timing: its points, the rule reduced from them, the threads and the seconds it took."""
    rule: CascadeRule
    timings: tuple[CascadeTiming, ...]
    num_threads: int
    seconds: float
    cut_short: bool = False    # the budget ran out before the grid did

    def describe(self) -> str:
        cut = ", cut short by its time budget" if self.cut_short else ""
        return (f"{self.rule.describe()} (timed at start-up: {len(self.timings)} points, {self.num_threads} "
                f"thread(s), {self.seconds * 1e3:.0f} ms{cut})")


class CascadeBench:
    """One layer's KV cache large enough for the biggest point, and the two kernels timed over it."""

    def __init__(self, kernels, shape: AttentionShape, max_group_size: int, max_shared_len: int,
                 own_len: int = OWN_LEN, seed: int = 0):
        """kernels: the compiled module (model/kernels.py's `kernels`)."""
        self.kernels, self.shape, self.own_len = kernels, shape, own_len
        self.generator = torch.Generator().manual_seed(seed)
        block_size = shape.block_size
        self.own_blocks = -(-(own_len + 1) // block_size)
        num_blocks = -(-max_shared_len // block_size) + max_group_size * self.own_blocks
        self.caches = [self._random_cache(cache_shape, num_blocks)
                       for cache_shape in kv_cache_shapes(num_blocks, block_size, shape.num_kv_heads, shape.head_dim)]
        self.scale = shape.head_dim ** -0.5

    def _random_cache(self, cache_shape: tuple[int, ...], num_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        data = quantize(torch.randn(cache_shape, generator=self.generator), self.shape.kv_cache_dtype)[0]
        if not has_scales(self.shape.kv_cache_dtype):
            return data, None
        scales_shape = kv_scales_shape(num_blocks, self.shape.block_size, self.shape.num_kv_heads)
        return data, torch.rand(scales_shape, generator=self.generator) / 64 + 1e-3

    def time(self, group_size: int, shared_len: int, reps: int) -> CascadeTiming:
        """group_size decodes whose tables share shared_len keys' blocks, then hold own_len keys each in blocks of
        their own (drawn at random from the rest): the plain decode kernel's and the cascade's best of reps calls,
        taken in turns."""
        shape, block_size = self.shape, self.shape.block_size
        shared_blocks = -(-shared_len // block_size)
        spare = self.caches[0][0].shape[0] - shared_blocks
        own = torch.randperm(spare, generator=self.generator)[:group_size * self.own_blocks] + shared_blocks
        tables = torch.cat([torch.arange(shared_blocks).expand(group_size, -1),
                            own.view(group_size, self.own_blocks)], 1).contiguous()
        contexts = torch.full((group_size,), shared_len + self.own_len)
        q = torch.randn(group_size, shape.num_heads, shape.head_dim, generator=self.generator).to(shape.dtype)
        out = torch.empty_like(q)
        groups = find_shared_prefixes(tables.numpy(), contexts.numpy(), block_size, ALWAYS)
        rows, starts, seq_lens = torch.arange(group_size), torch.arange(group_size + 1), contexts + 1
        (k_cache, k_scales), (v_cache, v_scales) = self.caches

        def plain():
            self.kernels.paged_attention(out, q, k_cache, v_cache, k_scales, v_scales, tables, rows, seq_lens,
                                         self.scale, 0, 0.0)

        def cascade():
            self.kernels.cascade_attention(out, q, k_cache, v_cache, k_scales, v_scales, tables, starts, contexts,
                                           groups.group_seqs, groups.group_starts, groups.shared_lens, self.scale, 0.0)
        best = [float("inf"), float("inf")]
        for _ in range(reps + 1):   # the first round warms caches and pages
            for index, kernel in enumerate((plain, cascade)):
                started = time.perf_counter()
                kernel()
                best[index] = min(best[index], time.perf_counter() - started)
        return CascadeTiming(group_size, shared_len, *best)


def measure_cascade_rule(kernels, shape: AttentionShape, group_sizes: tuple[int, ...] = STARTUP_GROUP_SIZES,
                         shared_lens: tuple[int, ...] = STARTUP_SHARED_LENS, reps: int = STARTUP_REPS,
                         budget_seconds: float = STARTUP_BUDGET_SECONDS) -> CascadeMeasurement:
    """Times each group size, smallest first, from the longest shared length down, stopping at its first loss (the
    rule takes wins from the longest down only) or when budget_seconds have passed; reduces the points to the
    rule."""
    started = time.perf_counter()
    bench = CascadeBench(kernels, shape, max(group_sizes), max(shared_lens))
    timings, cut_short = [], False
    for size in sorted(group_sizes):
        for shared_len in sorted(shared_lens, reverse=True):
            if timings and time.perf_counter() - started > budget_seconds:
                cut_short = True
                break
            timings.append(bench.time(size, shared_len, reps))
            if not timings[-1].wins:
                break
        if cut_short:
            break
    return CascadeMeasurement(rule_from_timings(timings), tuple(timings), torch.get_num_threads(),
                              time.perf_counter() - started, cut_short)
