"""Which kernel attends prefill chunks on the cpu backend: chosen once, when the backend is built, and logged.

The paths walk the same tiles (csrc/attention_tiles.h: 512 keys at a time, online softmax, K/V read through the
block tables, causal mask, cached prefix, sliding window, soft-capping) and differ in the tile products:
  tiles   QK^T and PV in registers (csrc/prefill_attention.cpp): vdpbf16ps on bfloat16 pairs where the CPU
          has AVX512-BF16, float FMAs elsewhere; every model and KV cache dtype
  brgemm  QK^T and PV as oneDNN brgemm calls (csrc/brgemm_tiles.cpp), each K/V tile packed from the blocks
          first: in bfloat16 for a bfloat16 model and KV cache (AMX tiles where the CPU has them, AVX512-BF16
          elsewhere), in float for a float32 model over a float32 or bfloat16 cache (widened as packed)
The default is brgemm where oneDNN runs it on AMX for a bfloat16 model and cache (on AVX512-BF16 without AMX
the register kernel is as fast or faster), and on AVX-512 for a float32 model (1.3-1.7x the register tiles'
speed on prompts of 290-2,048 tokens on Ice Lake, level at 128: docs/kv-cache.md, "Float queries on brgemm");
tiles elsewhere. PAGEDLLM_ATTENTION_PATH=tiles|brgemm forces one (tests check each); brgemm where it cannot run
is refused at start-up with the reason. Groups sharing prefix blocks take the cascade kernel either way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedllm.model.quantized_matmul import brgemm_isa

PATHS = ("tiles", "brgemm")
FORCE_VARIABLE = "PAGEDLLM_ATTENTION_PATH"
# Per operand dtype, the oneDNN ISAs on which brgemm is the default (where it was measured faster, or built for:
# AMX).
BRGEMM_BY_DEFAULT = {torch.bfloat16: ("avx512_core_amx",), torch.float32: ("avx512_core",)}


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


def brgemm_operands(dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the brgemm path multiplies in for a model of dtype over a cache of cache_dtype, or None where it
    takes neither."""
    if dtype == torch.bfloat16 and cache_dtype == torch.bfloat16:
        return torch.bfloat16
    if dtype == torch.float32 and cache_dtype in (torch.float32, torch.bfloat16):
        return torch.float32
    return None


def choose_prefill_path(dtype: torch.dtype, cache_dtype: torch.dtype) -> PrefillPath:
    """The path for a model of dtype over a KV cache of cache_dtype on this CPU (with the compiled kernels);
    PAGEDLLM_ATTENTION_PATH, if set, forces one: ValueError if it cannot run here."""
    operands = brgemm_operands(dtype, cache_dtype)
    isa = brgemm_isa(operands) if operands is not None else None
    forced = os.environ.get(FORCE_VARIABLE, "").strip().lower() or None
    if forced is None:
        by_default = operands is not None and isa in BRGEMM_BY_DEFAULT[operands]
        return PrefillPath("brgemm", isa) if by_default else PrefillPath("tiles")
    if forced not in PATHS:
        raise ValueError(f"{FORCE_VARIABLE} must be one of {', '.join(PATHS)}, got {forced!r}")
    if forced == "tiles":
        return PrefillPath("tiles")
    if operands is None:
        raise ValueError(f"{FORCE_VARIABLE}=brgemm: needs a bfloat16 model and KV cache, or a float32 model and a "
                         f"float32 or bfloat16 KV cache, got a {str(dtype).removeprefix('torch.')} model and a "
                         f"{str(cache_dtype).removeprefix('torch.')} cache")
    if isa is None:
        needs = "AVX512-BF16 or AMX" if operands == torch.bfloat16 else "AVX2 or AVX-512"
        raise ValueError(f"{FORCE_VARIABLE}=brgemm: oneDNN's brgemm does not run "
                         f"{str(operands).removeprefix('torch.')} on this CPU (it needs {needs}, and the C++ kernels "
                         "built)")
    return PrefillPath("brgemm", isa)
