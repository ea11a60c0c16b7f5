"""The attention backend: chosen once per engine, then called by every layer of every step.

- `cpu`: the C++ kernels (csrc/), reading K/V in place through the block tables; the CPU default.
- `triton`: the Triton kernels (triton_kernels.py, extra `pagedllm[cuda]`); the CUDA default. On CPU it
  runs only under Triton's interpreter (TRITON_INTERPRET=1 before the engine starts), which is how the
  tests check it without a GPU.
- `torch`: the PyTorch reference (gather each row's blocks, SDPA); any device, any layout.

"auto" takes the device's default (on CUDA that needs Triton installed; `torch` serves without it);
PAGEDLLM_ATTENTION_BACKEND (as vLLM's VLLM_ATTENTION_BACKEND) names one
when the engine argument is left at "auto". A backend that cannot take the model's layout (head size,
block size, dtypes, device, sliding windows, soft-capping) is refused here, at start-up, with the reason:
no step ever falls back.
"""
from __future__ import annotations

import os

import torch

from pagedllm.model.attention.cpu import CpuAttentionBackend, head_dim_fits
from pagedllm.model.attention.metadata import AttentionBackend, LayerAttention
from pagedllm.model.attention.torch_reference import TorchAttentionBackend
from pagedllm.model.kernels import kernels

FORCE_VARIABLE = "PAGEDLLM_ATTENTION_BACKEND"
BACKEND_NAMES = ("cpu", "triton", "torch")


def kernel_available(device: torch.device, head_dim: int) -> bool:
    """Whether the C++ kernels serve: built, on CPU, and a head size they vectorise."""
    return kernels is not None and device.type == "cpu" and head_dim_fits(head_dim)


def requested_backend(requested: str) -> str:
    """The engine argument, or for "auto" the environment's choice (still "auto" when unset)."""
    if requested == "auto":
        requested = os.environ.get(FORCE_VARIABLE, "auto").strip().lower() or "auto"
        where = FORCE_VARIABLE
    else:
        where = "attention_backend"
    if requested not in ("auto", *BACKEND_NAMES):
        raise ValueError(f"{where} must be one of auto, {', '.join(BACKEND_NAMES)}, got {requested!r}")
    return requested


def select_attention_backend(requested: str, device: torch.device, head_dim: int, block_size: int,
                             dtype: torch.dtype, cache_dtype: torch.dtype,
                             layers: tuple[LayerAttention, ...] = ()) -> AttentionBackend:
    """The backend for this engine's model and cache layout (layers: how each layer attends); ValueError if
    the one asked for cannot serve."""
    name = requested_backend(requested)
    if name == "auto":
        name = "triton" if device.type == "cuda" else ("cpu" if kernel_available(device, head_dim) else "torch")
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if not kernel_available(device, head_dim):
            raise ValueError(f"attention_backend 'cpu' needs the compiled C++ kernels, a CPU device and a head size "
                             f"that is a multiple of 16 up to 256; here: device {device}, head_dim {head_dim}, "
                             f"kernels {'built' if kernels is not None else 'not built'}")
        return CpuAttentionBackend(dtype, cache_dtype)
    try:
        from pagedllm.model.attention.triton_backend import TritonBackend
    except ImportError as error:
        raise ValueError(f"attention_backend 'triton' needs Triton: pip install 'pagedllm[cuda]' ({error})") from None
    return TritonBackend(device, head_dim, block_size, dtype, cache_dtype, layers)

