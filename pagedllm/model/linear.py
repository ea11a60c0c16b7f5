"""Linear layers whose weights are laid out once for oneDNN where that is faster.

On CPUs with fast bfloat16, oneDNN matmuls against a pre-reordered (blocked) weight run
1.2-2x faster for the small batches of decode steps than F.linear, which reorders the
weight on every call; results are bitwise the same. Elsewhere (float32, CUDA) F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks its blocked layout for this many rows; measured good from 8 to 2048 rows.
_BATCH_SIZE_HINT = 64


def padded_rows(num_rows: int) -> int:
    """num_rows rounded up to one of a few dozen sizes (multiples of 8, then 64, then 256).

    oneDNN builds and caches one primitive per input shape: fed every raw batch size a
    server sees, its cache grew the process by ~25 MiB per hundred requests (measured).
    Steps of 8 rows cost no measurable throughput (`pagedllm bench throughput`, within noise).
    """
    step = 8 if num_rows <= 256 else 64 if num_rows <= 1024 else 256
    return -(-num_rows // step) * step


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.prepacked = can_prepack(weight.dtype, weight.device)
        if self.prepacked:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT)
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prepacked:
            return F.linear(x, self.weight, self.bias)
        num_rows = x.shape[0]
        padding = padded_rows(num_rows) - num_rows
        if padding:   # the logits rows; the model pads its batch itself (CausalLM.forward)
            x = F.pad(x, (0, 0, 0, padding))
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out[:num_rows] if padding else out
