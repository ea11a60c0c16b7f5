"""The rule that decides per step which shared-prefix groups the cascade kernel serves: reduced from hand-made
timing tables (the start-up timing's results vary by machine, so no test assumes them), the start-up timing's
grid walk, and the start-up choice for each enable_cascade_attention setting."""
import pytest
import torch

from pagedllm.model import kernels
from pagedllm.model.cascade import (ALWAYS, MIN_SPEED_UP, CascadeRule, CascadeTiming, find_shared_prefixes,
                                    rule_from_timings)
from pagedllm.model.cascade_timing import AttentionShape, measure_cascade_rule
from pagedllm.worker.cascade_choice import choose_cascade, why_not_possible

SHAPE = AttentionShape(9, 3, 64, torch.float32, torch.float32, 16)


def table(rows: dict[int, dict[int, float]]) -> list[CascadeTiming]:
    """{group size: {shared keys: plain / cascade}} as timings (the cascade at 1 s)."""
    return [CascadeTiming(size, shared, ratio, 1.0) for size, ratios in rows.items() for shared, ratio in ratios.items()]


def test_rule_takes_per_size_the_least_length_from_which_every_longer_one_wins():
    # Shaped like the idle 2-thread figures of docs/kv-cache.md, with a noisy win below a loss at 16.
    rule = rule_from_timings(table({
        2: {1024: 0.55},
        4: {1024: 0.81},
        8: {1024: 1.43, 512: 1.3, 256: 1.09, 128: 0.86},
        16: {1024: 1.5, 512: 0.9, 256: 1.2},
        64: {1024: 2.17, 512: 1.9, 256: 1.6, 128: 1.26, 64: 0.95},
    }))
    assert rule.thresholds == ((2, None), (4, None), (8, 256), (16, 1024), (64, 128))
    assert [rule.min_shared_len(n) for n in (2, 3, 4, 7)] == [None] * 4
    # a size follows the least threshold among the sizes up to it: 16 keeps 8's 256, 64 and more take 128
    assert [rule.min_shared_len(n) for n in (8, 15, 16, 63, 64, 256)] == [256, 256, 256, 256, 128, 128]
    assert rule.smallest_group == 8
    assert rule.describe() == "8+ sequences from 256 shared keys; 64+ sequences from 128 shared keys"


def test_a_win_needs_the_margin():
    just_under, at = MIN_SPEED_UP - 0.01, MIN_SPEED_UP
    assert rule_from_timings(table({4: {1024: at, 512: just_under}})).thresholds == ((4, 1024),)
    assert rule_from_timings(table({4: {1024: just_under}})).thresholds == ((4, None),)


def test_a_rule_that_keeps_nothing():
    rule = rule_from_timings(table({2: {1024: 0.5}, 64: {1024: 0.9}}))
    assert rule.smallest_group is None and rule.describe() == "no group pays"
    tables = torch.zeros(64, 70, dtype=torch.int64).numpy()   # 64 sequences sharing 70 blocks
    contexts = torch.full((64,), 1100).numpy()
    assert find_shared_prefixes(tables, contexts, 16, rule) is None
    assert find_shared_prefixes(tables, contexts, 16, ALWAYS).shared_lens.tolist() == [1100]


def test_the_rule_decides_each_group_by_its_size_and_shared_length():
    rule = CascadeRule(((2, None), (4, 64), (8, 32)))
    # sequences 0-3 share 5 blocks (80 keys), 4-11 share 3 (48 keys), 12-13 share 6 (96 keys)
    tables = torch.tensor([[0, 1, 2, 3, 4, 20 + i] for i in range(4)] + [[5, 6, 7, 30 + i, 0, 0] for i in range(8)]
                          + [[10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 14, 15]]).numpy()
    contexts = torch.tensor([90] * 4 + [50] * 8 + [96, 96]).numpy()
    found = find_shared_prefixes(tables, contexts, 16, rule)
    groups = {tuple(sorted(found.group_seqs[a:b].tolist())): shared
              for a, b, shared in zip(found.group_starts[:-1].tolist(), found.group_starts[1:].tolist(),
                                      found.shared_lens.tolist())}
    assert groups == {(0, 1, 2, 3): 80, tuple(range(4, 12)): 48}   # the pair never pays
    assert find_shared_prefixes(tables, contexts, 16, CascadeRule(((2, None), (4, 81), (8, 49)))) is None


def test_rule_checks_its_sizes():
    for thresholds in ((), ((1, 16),), ((8, 16), (4, 32)), ((4, 16), (4, 32))):
        with pytest.raises(ValueError, match="distinct group sizes >= 2 in ascending order"):
            CascadeRule(thresholds)


def test_cascade_setting_is_resolved_without_timing_where_it_cannot_or_need_not_run():
    assert choose_cascade(False, False, None, SHAPE).rule is None
    assert choose_cascade(True, False, None, SHAPE).rule == ALWAYS
    impossible = why_not_possible(False, "torch", True, 30)
    assert impossible == "attention backend torch: the cascade kernel is C++ only"
    off = choose_cascade(None, False, impossible, SHAPE)
    assert (off.setting, off.rule, off.measurement) == ("auto", None, None)
    assert off.describe() == f"off ({impossible})"
    assert choose_cascade(True, False, why_not_possible(True, "cpu", False, 12), SHAPE).rule is None
    assert why_not_possible(True, "cpu", True, 0) == "every attention layer has a sliding window"
    assert why_not_possible(True, "cpu", True, 1) is None
    invariant = choose_cascade(None, True, None, SHAPE)
    assert invariant.rule is None and invariant.measurement is None and "batch_invariant" in invariant.reason


@pytest.mark.kernels
@pytest.mark.skipif(kernels.kernels is None, reason="needs the C++ kernels")
def test_startup_timing_walks_each_size_down_to_its_first_loss():
    measurement = measure_cascade_rule(kernels.kernels, SHAPE, group_sizes=(2, 4), shared_lens=(16, 32, 48), reps=1)
    assert not measurement.cut_short and measurement.num_threads == torch.get_num_threads()
    for size in (2, 4):
        points = [t for t in measurement.timings if t.group_size == size]
        assert [t.shared_len for t in points] == [48, 32, 16][:len(points)]
        assert all(t.wins for t in points[:-1]) and (len(points) == 3 or not points[-1].wins)
        assert all(t.plain_seconds > 0 and t.cascade_seconds > 0 for t in points)
    assert measurement.rule == rule_from_timings(list(measurement.timings))
    chosen = choose_cascade(None, False, None, SHAPE)
    assert chosen.setting == "auto" and chosen.rule == chosen.measurement.rule


@pytest.mark.kernels
@pytest.mark.skipif(kernels.kernels is None, reason="needs the C++ kernels")
def test_startup_timing_stops_at_its_budget():
    measurement = measure_cascade_rule(kernels.kernels, SHAPE, group_sizes=(2, 4), shared_lens=(16, 32), reps=1,
                                       budget_seconds=0)
    assert measurement.cut_short and len(measurement.timings) == 1
    assert (measurement.timings[0].group_size, measurement.timings[0].shared_len) == (2, 32)
    assert "cut short by its time budget" in measurement.describe()
