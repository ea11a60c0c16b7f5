"""The throughput bench's compute floor (pagedllm/bench/compute_floor.py): FLOPs counted by hand for a small
model shape, and prompt tokens found in the prefix cache left out (they never pass the layers)."""
from __future__ import annotations

from types import SimpleNamespace

from pagedllm.bench.compute_floor import workload_flops
from pagedllm.bench.workload import BenchRequest

# 2 layers; q 4 heads x 8 = 32, k and v 2 heads x 8 = 16 each; hidden 32, MLP 48, vocabulary 100
CONFIG = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         hidden_size=32, intermediate_size=48, vocab_size=100)
# one token through one layer: qkv 64 x 32, o 32 x 32, gate/up 96 x 32, down 32 x 48 weights, 2 FLOPs each
LAYER_FLOPS_PER_TOKEN = 2 * (64 * 32 + 32 * 32 + 96 * 32 + 32 * 48)
HEAD_FLOPS_PER_TOKEN = 2 * 32 * 100


def test_every_prompt_token_and_every_output_token_but_the_last_pass_the_layers():
    workload = [BenchRequest([1] * 10, 4), BenchRequest([2] * 3, 1)]
    tokens_through_layers = (10 + 3) + (3 + 0)   # the last sampled token of each is never fed back
    expected = tokens_through_layers * 2 * LAYER_FLOPS_PER_TOKEN + (4 + 1) * HEAD_FLOPS_PER_TOKEN
    assert workload_flops(CONFIG, workload) == expected


def test_prompt_tokens_from_the_prefix_cache_are_not_counted():
    workload = [BenchRequest([1] * 10, 4), BenchRequest([2] * 3, 1)]
    tokens_through_layers = (10 - 8 + 3) + (3 + 0)   # 8 of the first prompt's tokens came from the cache
    expected = tokens_through_layers * 2 * LAYER_FLOPS_PER_TOKEN + (4 + 1) * HEAD_FLOPS_PER_TOKEN
    assert workload_flops(CONFIG, workload, num_cached_tokens=8) == expected
