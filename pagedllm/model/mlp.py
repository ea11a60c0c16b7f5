"""The gated feed-forward (SwiGLU, Gemma's GeGLU): gate and up projections in one matmul, then down. A dense layer's MLP,
each routed expert and Qwen2-MoE's shared expert are all one of these."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.distributed.parallel_state import SINGLE_PROCESS, TensorParallelGroup
from pagedllm.model.linear import fused_linear
from pagedllm.model.ops import gated_activation
from pagedllm.model.parallel_linear import row_parallel
from pagedllm.model.quantization import QuantizedWeight
from pagedllm.model.quantized_matmul import QuantizedMatmul


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) over the weights under `prefix`, act by transformers' name (ops.gated_activation).
    With a group of several ranks the down
    projection's partial sums are all-reduced here; experts pass none and their layer reduces once."""

    def __init__(self, w: Callable[[str], torch.Tensor | QuantizedWeight], prefix: str, matmul: QuantizedMatmul,
                 group: TensorParallelGroup = SINGLE_PROCESS, activation: str = "silu"):
        super().__init__()
        gate, up = w(prefix + "gate_proj.weight"), w(prefix + "up_proj.weight")
        device = gate.qweight.device if isinstance(gate, QuantizedWeight) else gate.device
        self.activation_name = activation
        self.activation = gated_activation(activation, device, gate.shape[0])
        self.gate_up_proj = fused_linear([gate, up], matmul=matmul)
        self.down_proj = row_parallel(fused_linear([w(prefix + "down_proj.weight")], matmul=matmul), group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x)))
