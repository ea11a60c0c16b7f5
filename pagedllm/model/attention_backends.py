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
from abc import ABC, abstractmethod

import torch

from pagedllm.model.attention import AttentionMetadata, CacheTensor, LayerAttention, kernel_available, paged_attention
from pagedllm.model.ops import _C

FORCE_VARIABLE = "PAGEDLLM_ATTENTION_BACKEND"
BACKEND_NAMES = ("cpu", "triton", "torch")


class AttentionBackend(ABC):
    name: str
    uses_cpu_kernels = False   # what AttentionMetadata.use_kernel tells paged_attention

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: CacheTensor,
                v_cache: CacheTensor, meta: AttentionMetadata, layer: LayerAttention) -> torch.Tensor:
        """paged_attention's contract: writes the new K/V, attends, returns [tokens, heads, head_dim] with zeros
        in the padding rows."""


class PagedAttentionBackend(AttentionBackend):
    """attention.paged_attention: the C++ kernels (`cpu`) or the PyTorch reference (`torch`)."""

    def __init__(self, uses_cpu_kernels: bool):
        self.uses_cpu_kernels = uses_cpu_kernels
        self.name = "cpu" if uses_cpu_kernels else "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta, layer):
        return paged_attention(q, k, v, k_cache, v_cache, meta, layer)


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
        return PagedAttentionBackend(uses_cpu_kernels=False)
    if name == "cpu":
        if not kernel_available(device, head_dim):
            raise ValueError(f"attention_backend 'cpu' needs the compiled C++ kernels, a CPU device and a head size "
                             f"that is a multiple of 16 up to 256; here: device {device}, head_dim {head_dim}, "
                             f"kernels {'built' if _C is not None else 'not built'}")
        return PagedAttentionBackend(uses_cpu_kernels=True)
    try:
        from pagedllm.model.triton_attention import TritonBackend
    except ImportError as error:
        raise ValueError(f"attention_backend 'triton' needs Triton: pip install 'pagedllm[cuda]' ({error})") from None
    return TritonBackend(device, head_dim, block_size, dtype, cache_dtype, layers)

