"""The compute floor of a workload: its model matmul FLOPs at this machine's matmul rate,
measured in the same run (the machine is shared and its speed drifts).

The rate is that of our own fastest matmul path (pagedllm.model.linear.Linear) on the
model's layer shapes at 2048 rows, a prefill-sized batch where the matmuls run at their
best; attention, norms and everything else count as overhead above the floor.
"""
from __future__ import annotations

import time

import torch

from pagedllm.bench.workload import BenchRequest
from pagedllm.model.config import ModelConfig
from pagedllm.model.linear import Linear


def layer_matmul_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's matmuls, fused as the model runs them."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, mlp = config.hidden_size, config.intermediate_size
    return [(q + 2 * kv, hidden), (hidden, q), (2 * mlp, hidden), (hidden, mlp)]


def workload_flops(config: ModelConfig, workload: list[BenchRequest], num_cached_tokens: int = 0) -> float:
    """Model matmul FLOPs: every token that passes the layers, plus the LM head once per output token.
    num_cached_tokens: prompt tokens the run found in the prefix cache (RequestOutput.num_cached_tokens), which
    never pass the layers."""
    per_token = 2 * config.num_hidden_layers * sum(o * i for o, i in layer_matmul_shapes(config))
    tokens_through_layers = sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in workload) - num_cached_tokens
    sampled = sum(r.max_tokens for r in workload)
    return tokens_through_layers * per_token + sampled * 2 * config.hidden_size * config.vocab_size


def measure_matmul_rate(config: ModelConfig, dtype: torch.dtype, rows: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the model's layer matmuls at `rows` rows, best of `repeats` timed passes."""
    generator = torch.Generator().manual_seed(0)
    layers = [Linear(torch.randn(o, i, generator=generator).to(dtype)) for o, i in layer_matmul_shapes(config)]
    inputs = [torch.randn(rows, i, generator=generator).to(dtype) for _, i in layer_matmul_shapes(config)]
    flops = 2 * rows * sum(o * i for o, i in layer_matmul_shapes(config))
    best = float("inf")
    with torch.inference_mode():
        for attempt in range(repeats + 2):   # the first passes warm caches and oneDNN's primitives
            started = time.perf_counter()
            for layer, x in zip(layers, inputs):
                layer(x)
            if attempt > 1:
                best = min(best, time.perf_counter() - started)
    return flops / best
