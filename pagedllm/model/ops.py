"""The compiled CPU kernels (`_C`: the variant kernels.py chose for this CPU, None where not built),
and a decoder layer's element-wise steps: the kernels of csrc/layer_ops.cpp on CPU, PyTorch formulas elsewhere
(CUDA, no compiled extension, or sizes the kernels do not vectorise). Tests hold the two
to the same results."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pagedllm.model.kernels import kernels as _C


def on_cpu_kernel(x: torch.Tensor, multiple: int) -> bool:
    """Whether a kernel can take x: built, on CPU, last dimension a multiple of its vector width."""
    return _C is not None and x.is_cpu and x.shape[-1] % multiple == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
    """weight * x / rms(x) per row. With residual: first residual += x in place (the
    residual stream), then the sum is normalised."""
    if on_cpu_kernel(x, 16) and x.is_contiguous():
        out = torch.empty_like(x)
        if residual is None:
            _C.rms_norm(out, x, weight, eps)
        else:
            _C.add_rms_norm(out, residual, x, weight, eps)
        return out
    if residual is not None:
        x = residual.add_(x)
    return F.rms_norm(x, weight.shape, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    size = gate_up.shape[-1] // 2
    if on_cpu_kernel(gate_up, 32) and gate_up.is_contiguous():
        out = gate_up.new_empty(*gate_up.shape[:-1], size)
        _C.silu_and_mul(out, gate_up)
        return out
    gate, up = gate_up.split(size, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(gate_up: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(gate) * up (GeGLU) for gate_up = [gate | up]; approximate: "tanh" (Gemma's) or "none"."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


# act(gate) * up for each of ModelConfig's hidden_activation names (transformers' names).
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": partial(gelu_and_mul, approximate="tanh"),
    "gelu": partial(gelu_and_mul, approximate="none"),
}
