"""How a model splits over tensor-parallel ranks: which part of each weight a rank holds, and the
sizes that must divide.

Q/K/V and gate/up are column-parallel (each rank holds some output rows: whole heads, a slice of the
intermediate size); o_proj and down_proj are row-parallel (the matching input columns; the partial
sums are all-reduced); the embedding and LM head hold a slice of the vocabulary. With more ranks than
KV heads, each KV head is replicated on tp_size / num_key_value_heads consecutive ranks, the ones whose
query heads read it. A mixture of experts splits every expert (and the shared one) like a dense MLP: each
rank routes alike with the whole router and holds a slice of each expert's intermediate size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model.config import ModelConfig
from pagedllm.model.moe_config import gated_mlp_prefixes

QUANTIZED_GROUP_COLUMNS = 32   # the widest group of any quantized format (quantization.py)


@dataclass(frozen=True)
class Shard:
    """Part `index` of `count` equal parts of a weight along `dim` (0: output rows, 1: input columns)."""
    dim: int
    index: int
    count: int

    def bounds(self, length: int) -> tuple[int, int]:
        size = length // self.count
        return self.index * size, (self.index + 1) * size

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part as a tensor of its own, so the whole one can be freed."""
        start, stop = self.bounds(tensor.shape[self.dim])
        return tensor.narrow(self.dim, start, stop - start).clone(memory_format=torch.contiguous_format)


def kv_head_replicas(config: ModelConfig, tp_size: int) -> int:
    return max(1, tp_size // config.num_key_value_heads)


def num_kv_heads_per_rank(config: ModelConfig, tp_size: int) -> int:
    return max(1, config.num_key_value_heads // tp_size)


def weight_shards(config: ModelConfig, rank: int, tp_size: int) -> dict[str, Shard]:
    """The part of every sharded weight that `rank` holds, by HF name (norms are whole on every rank)."""
    rows, columns = Shard(0, rank, tp_size), Shard(1, rank, tp_size)
    replicas = kv_head_replicas(config, tp_size)
    kv_rows = Shard(0, rank // replicas, tp_size // replicas)
    shards = {"model.embed_tokens.weight": rows, "lm_head.weight": rows}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for kind in ("weight", "bias"):
            shards[f"{prefix}self_attn.q_proj.{kind}"] = rows
            shards[f"{prefix}self_attn.k_proj.{kind}"] = kv_rows
            shards[f"{prefix}self_attn.v_proj.{kind}"] = kv_rows
        shards[prefix + "self_attn.o_proj.weight"] = columns
        for mlp in gated_mlp_prefixes(config.moe, layer, prefix + "mlp."):
            shards |= {mlp + "gate_proj.weight": rows, mlp + "up_proj.weight": rows, mlp + "down_proj.weight": columns}
    return shards


def check_tensor_parallel_size(config: ModelConfig, tp_size: int, quantized: bool) -> None:
    """ValueError naming the first size that does not split over tp_size ranks.
    quantized: the row-parallel weights are group-quantized, so each rank's input columns must be whole
    groups."""
    def must_divide(name: str, value: int) -> None:
        if value % tp_size:
            raise ValueError(f"tensor_parallel_size must divide {name} ({value}), got {tp_size}")

    must_divide("num_attention_heads", config.num_attention_heads)
    kv_heads = config.num_key_value_heads
    if tp_size > kv_heads and tp_size % kv_heads:
        raise ValueError(f"tensor_parallel_size must divide num_key_value_heads ({kv_heads}) or be a multiple "
                         f"of it (each KV head then replicated), got {tp_size}")
    if tp_size <= kv_heads:
        must_divide("num_key_value_heads", kv_heads)
    intermediate_sizes = {"intermediate_size": config.intermediate_size}
    if config.moe is not None:
        intermediate_sizes |= {"moe_intermediate_size": config.moe.moe_intermediate_size,
                               "shared_expert_intermediate_size": config.moe.shared_expert_intermediate_size}
    for name, size in intermediate_sizes.items():
        must_divide(name, size)
    must_divide("vocab_size", config.vocab_size)
    if quantized:
        for name, columns in (("num_attention_heads * head_dim", config.num_attention_heads * config.head_dim),
                              *intermediate_sizes.items()):
            if columns // tp_size % QUANTIZED_GROUP_COLUMNS:
                raise ValueError(f"with quantized weights, {name} ({columns}) / tensor_parallel_size ({tp_size}) "
                                 f"must be a multiple of {QUANTIZED_GROUP_COLUMNS} (whole quantization groups "
                                 f"per rank); use quantization='none' or another tensor_parallel_size")
