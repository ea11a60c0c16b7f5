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
speed on prompts of 290-2,048 tokens on Ice Lake, level at 128: docs/kv-cache.md, "Float queries on brgemm").
On AVX2 a float32 model takes brgemm for steps whose longest prefill chunk reaches BRGEMM_BY_DEFAULT's length
and the tiles below it: brgemm packs each chunk's K/V tiles before it multiplies, which a short chunk does not
repay there (an AMD EPYC with AVX2 only: 0.93x the tiles' speed at 128 tokens, 1.22x at 256, 1.42x at 512;
docs/kv-cache.md, "AVX2: brgemm for long chunks only"). Tiles elsewhere. PAGEDLLM_ATTENTION_PATH=tiles|brgemm
forces one for every chunk (tests check each); brgemm where it cannot run is refused at start-up with the reason.
Groups sharing prefix blocks take the cascade kernel either way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedllm.model.quantized_matmul import brgemm_isa

PATHS = ("tiles", "brgemm")
FORCE_VARIABLE = "PAGEDLLM_ATTENTION_PATH"
TILES_OP, BRGEMM_OP = "prefill_attention", "prefill_attention_brgemm"
# Per operand dtype, the oneDNN ISAs on which brgemm is the default (where it was measured faster, or built for:
# AMX), each with the chunk length below which a step keeps the tiles (0: none).
BRGEMM_BY_DEFAULT = {torch.bfloat16: {"avx512_core_amx": 0}, torch.float32: {"avx512_core": 0, "avx2": 256}}


@dataclass(frozen=True)
class PrefillPath:
    """A prefill path and, for brgemm, the ISA oneDNN runs it on and the chunk length below which a step keeps
    the tiles (0: brgemm for every step)."""
    name: str
    isa: str | None = None
    tiles_below: int = 0

    @property
    def ops(self) -> tuple[str, ...]:
        """The compiled functions the path calls."""
        if self.name != "brgemm":
            return (TILES_OP,)
        return (BRGEMM_OP, TILES_OP) if self.tiles_below else (BRGEMM_OP,)

    def op_for(self, longest_chunk: int) -> str:
        """The compiled function for a step whose longest prefill chunk has longest_chunk tokens."""
        return BRGEMM_OP if self.name == "brgemm" and longest_chunk >= self.tiles_below else TILES_OP

    def describe(self) -> str:
        if self.name != "brgemm":
            return "tiles"
        below = f"; tiles for steps whose chunks are all under {self.tiles_below} tokens" if self.tiles_below else ""
        return f"brgemm (oneDNN {self.isa}){below}"


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
        tiles_below = BRGEMM_BY_DEFAULT[operands].get(isa) if operands is not None else None
        return PrefillPath("brgemm", isa, tiles_below) if tiles_below is not None else PrefillPath("tiles")
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
