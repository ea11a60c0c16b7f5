"""Which kernel attends prefill chunks on the cpu backend: chosen once, when the backend is built, and logged.

The paths walk the same tiles (csrc/attention_tiles.h: 512 keys at a time, online softmax, K/V read through the
block tables, causal mask, cached prefix, sliding window, soft-capping) and differ in the tile products:
  tiles   QK^T and PV in registers (csrc/prefill_attention.cpp): vdpbf16ps on bfloat16 pairs where the CPU
          has AVX512-BF16, float FMAs elsewhere; every model and KV cache dtype
  brgemm  QK^T and PV as oneDNN brgemm calls in bfloat16 (csrc/brgemm_tiles.cpp), each K/V tile packed
          from the blocks first: AMX tiles where the CPU has them, AVX512-BF16 elsewhere; a bfloat16
          model and KV cache only
The default is brgemm where oneDNN runs it on AMX and model and cache are bfloat16, tiles elsewhere (on
AVX512-BF16 without AMX the register kernel is as fast or faster: docs/performance.md has the figures).
PAGEDLLM_ATTENTION_PATH=tiles|brgemm forces one (tests check each); brgemm where it cannot run is refused at
start-up with the reason. Groups sharing prefix blocks take the cascade kernel (register products) either way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedllm.model.quantized_matmul import brgemm_isa

PATHS = ("tiles", "brgemm")
FORCE_VARIABLE = "PAGEDLLM_ATTENTION_PATH"
# The oneDNN ISAs on which brgemm is the default (the ones it was measured faster on, or built for: AMX).
BRGEMM_BY_DEFAULT = ("avx512_core_amx",)


@dataclass(frozen=True)
class PrefillPath:
    """A prefill path and, for brgemm, the ISA oneDNN runs it on."""
    name: str
    isa: str | None = None

    @property
    def op(self) -> str:
        """The compiled function's name."""
        return "prefill_attention_brgemm" if self.name == "brgemm" else "prefill_attention"

    def describe(self) -> str:
        return f"brgemm (oneDNN {self.isa})" if self.name == "brgemm" else "tiles"


def choose_prefill_path(dtype: torch.dtype, cache_dtype: torch.dtype) -> PrefillPath:
    """The path for a model of dtype over a KV cache of cache_dtype on this CPU (with the compiled kernels);
    PAGEDLLM_ATTENTION_PATH, if set, forces one: ValueError if it cannot run here."""
    isa = brgemm_isa(torch.bfloat16)
    bfloat16 = dtype == torch.bfloat16 and cache_dtype == torch.bfloat16
    forced = os.environ.get(FORCE_VARIABLE, "").strip().lower() or None
    if forced is None:
        return PrefillPath("brgemm", isa) if bfloat16 and isa in BRGEMM_BY_DEFAULT else PrefillPath("tiles")
    if forced not in PATHS:
        raise ValueError(f"{FORCE_VARIABLE} must be one of {', '.join(PATHS)}, got {forced!r}")
    if forced == "tiles":
        return PrefillPath("tiles")
    if isa is None:
        raise ValueError(f"{FORCE_VARIABLE}=brgemm: oneDNN's brgemm does not run bfloat16 on this CPU (it needs "
                         f"AVX512-BF16 or AMX, and the C++ kernels built)")
    if not bfloat16:
        raise ValueError(f"{FORCE_VARIABLE}=brgemm: needs a bfloat16 model and KV cache, got a "
                         f"{str(dtype).removeprefix('torch.')} model and a {str(cache_dtype).removeprefix('torch.')} "
                         "cache")
    return PrefillPath("brgemm", isa)
