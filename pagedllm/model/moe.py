"""The sparse mixture-of-experts feed-forward of Mixtral, Qwen2-MoE and Qwen3-MoE.

A router scores every expert for each token and the top k run. The step's (token, expert) pairs are
sorted by expert once, so each expert that any token picked runs one gate_up and one down matmul over
all of its rows, and an expert nobody picked costs nothing. Each expert is a GatedMLP of its own (float,
int8/int4 or GGUF-quantized weights alike). Under tensor parallelism every rank routes alike (same
input, the whole router) and holds a slice of each expert's intermediate size, so the layer's output is
a partial sum: all-reduced once.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.linear import fused_linear
from pagedllm.model.mlp import GatedMLP
from pagedllm.model.moe_config import MoeConfig
from pagedllm.model.quantization import QuantizedWeight
from pagedllm.model.quantized_matmul import QuantizedMatmul


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts [tokens, top_k] and their weights (float32): softmax over every expert,
    the k largest, renormalised to sum to one when norm_topk_prob (Mixtral's softmax over its top-k logits)."""
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = probabilities.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeConfig, w: Callable[[str], torch.Tensor | QuantizedWeight], prefix: str,
                 group: TensorParallelGroup, matmul: QuantizedMatmul):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.group = moe.num_experts_per_tok, moe.norm_topk_prob, group
        self.gate = fused_linear([w(prefix + "gate.weight")], matmul=matmul)   # the router
        self.experts = nn.ModuleList(GatedMLP(w, f"{prefix}experts.{expert}.", matmul)
                                     for expert in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(w, prefix + "shared_expert.", matmul)
            self.shared_expert_gate = fused_linear([w(prefix + "shared_expert_gate.weight")], matmul=matmul)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(hidden), self.top_k, self.norm_topk_prob)
        out = self._routed_experts(hidden, weights, experts)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return self.group.all_reduce(out)

    def _routed_experts(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over k of weight_k * expert_k(token), grouped by expert: one pass of each picked expert."""
        picks = experts.flatten()                     # pair i is token i // top_k's (i % top_k)-th expert
        order = picks.argsort(stable=True)            # the pairs grouped by expert
        tokens = order // self.top_k
        rows_per_expert = torch.bincount(picks, minlength=len(self.experts)).tolist()
        grouped = hidden[tokens]
        outputs = torch.empty_like(grouped)
        start = 0
        for expert, num_rows in zip(self.experts, rows_per_expert):
            if num_rows:
                outputs[start:start + num_rows] = expert(grouped[start:start + num_rows])
                start += num_rows
        weighted = (outputs * weights.flatten()[order].unsqueeze(-1)).to(hidden.dtype)
        return torch.zeros_like(hidden).index_add_(0, tokens, weighted)
