"""The model-free simulation behind `pagedllm bench memory`, against hand-computed figures."""
import pytest

from pagedllm.bench.simulate import simulate
from pagedllm.bench.workload import BenchRequest, random_workload


def test_one_request_by_hand():
    # Prompt of 10 tokens, 3 new tokens, blocks of 8. After step 1 (prefill): 10 tokens in
    # 2 blocks; after step 2: 11 in 2; step 3 samples the last token and frees everything.
    result = simulate([BenchRequest(list(range(10)), 3)], num_blocks=64, block_size=8)
    assert result.steps == 3 and result.peak_running == 1 and result.preemptions == 0
    assert (result.stored_tokens, result.used_slots) == (10 + 11, 16 + 16)
    assert result.utilization == pytest.approx(21 / 32)
    assert result.reserved_utilization(100) == pytest.approx(21 / 200)
    assert result.oracle_utilization == pytest.approx(21 / 26)


def test_tight_pool_preempts_yet_finishes_everything():
    workload = random_workload(num=24)
    roomy = simulate(workload, num_blocks=4096, block_size=16)
    tight = simulate(workload, num_blocks=200, block_size=16)
    assert roomy.preemptions == 0 and tight.preemptions > 0
    assert tight.peak_running < roomy.peak_running == 24
