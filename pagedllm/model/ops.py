"""A decoder layer's element-wise steps: the kernels of csrc/layer_ops.cpp on CPU, PyTorch formulas elsewhere
(CUDA, no compiled extension, or sizes the kernels do not vectorise). A layer takes its step from
`rms_norm_op` / `gated_activation` when it is built (kernels.kernel_for chooses and logs), never per call.
Tests hold the two paths to the same results."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pagedllm.model.kernels import kernel_for

RMSNorm = Callable[..., torch.Tensor]   # (x, weight, eps, residual=None) -> normalised x


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """weight * x / rms(x) per row. With residual: first residual += x in place (the
    residual stream), then the sum is normalised."""
    if residual is not None:
        x = residual.add_(x)
    return F.rms_norm(x, weight.shape, weight, eps)


def row_misfit(size: int) -> str | None:
    """Why the element-wise kernels cannot take rows of `size` (None: they can): they work in 16-lane vectors."""
    return None if size % 16 == 0 else f"rows of {size}, not a multiple of 16"


def rms_norm_op(device: torch.device, size: int) -> RMSNorm:
    """rms_norm_torch's contract for rows of `size` on `device`: the kernels where they serve, else torch's."""
    norm, add_norm = (kernel_for(op, device, row_misfit(size)) for op in ("rms_norm", "add_rms_norm"))
    if norm is None:
        return rms_norm_torch

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor:
        x = x.contiguous()   # a no-op but for q/k norms over views of qkv
        out = torch.empty_like(x)
        if residual is None:
            norm(out, x, weight, eps)
        else:
            add_norm(out, residual, x, weight, eps)
        return out
    return rms_norm


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(gate_up: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(gate) * up (GeGLU) for gate_up = [gate | up]; approximate: "tanh" (Gemma's) or "none"."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


# act(gate) * up for each of ModelConfig's hidden_activation names (transformers' names), in PyTorch.
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": partial(gelu_and_mul, approximate="tanh"),
    "gelu": partial(gelu_and_mul, approximate="none"),
}


def gated_activation(name: str, device: torch.device, size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """act(gate) * up for gate_up rows of 2 * size on `device`: silu's kernel where it serves, else torch's."""
    if name != "silu":
        return GATED_ACTIVATIONS[name]
    kernel = kernel_for("silu_and_mul", device, row_misfit(size))
    if kernel is None:
        return silu_and_mul

    def silu_and_mul_kernel(gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
        kernel(out, gate_up)
        return out
    return silu_and_mul_kernel
