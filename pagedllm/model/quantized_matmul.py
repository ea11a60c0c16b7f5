"""Which kernel multiplies activations by quantized weights, per activation dtype and row count: chosen once,
when a model is built, and logged; a call only looks its row count up.

The paths (csrc/quant_matmul.cpp, csrc/quant_linear.cpp):
  rows    float or bfloat16 activations against weights dequantized in registers, 8 rows per pass over
          the weights (2 on AVX2); each row's result independent of the batch (few rows: decode)
  brgemm  blocks of weights dequantized to bfloat16 or float32, oneDNN's brgemm micro-kernel (many rows:
          prefill, large batches); oneDNN generates it for AMX, AVX-512 (BF16) or AVX2
  int8    activations quantized to int8 per row and 32-column group, integer dot products: the opt-in
          activation_dtype="int8" (less accurate; docs/quantized_matmul.md), up to 8 rows per pass (few rows)
  int8_tiles  int8's sums, bit for bit, register-blocked for many rows over weights unpacked once per call
          (VNNI builds; elsewhere it runs int8's kernel)
  int16   activations quantized to int16 per row and 32-column group (256 times int8's resolution: as accurate as
          float activations, docs/quantized_matmul.md), integer products at up to twice float32's rate: up to 16
          rows take the q values from the packed tiles into the products in registers, more meet them widened to
          int16 once per call (the same bits); every row count, and a row's result never depends on the batch.
          The default on AVX2 without AVX-512 and on AVX-512 with VNNI but no BF16 (Cascade Lake, Ice Lake)
  torch   the weight dequantized per call and F.linear: where the kernels are not built, or not on CPU (the
          model's device, given when the model is built: no call checks it)
PAGEDLLM_MATMUL_PATH=<path> forces one path for every row count (tests use it to check each); forced brgemm leaves
the activation dtypes it does not run here (float16; bfloat16 without AVX512-BF16 or AMX) on the rows kernel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedllm.model import kernels
from pagedllm.model.kernels import kernel_for

# auto: the model dtype, or int16 for many rows where the CPU multiplies int16 faster (int16_is_faster); model: the
# model dtype at every row count; int16 and int8: those quantized activations (int8 is less accurate).
ACTIVATION_DTYPES = ("auto", "model", "int16", "int8")
PATHS = ("rows", "brgemm", "int8", "int8_tiles", "int16", "torch")
FORCE_VARIABLE = "PAGEDLLM_MATMUL_PATH"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The row count from which brgemm beats the rows kernel, per activation dtype and the ISA oneDNN generates
# brgemm for (`pagedllm bench kernels` measures both; docs/quantized_matmul.md has the figures). Both costs
# grow with the weight's size, so the crossover is the same for every layer shape. bfloat16 on AVX512-BF16:
# re-measured after the rows kernel took llama.cpp's order (brgemm 1.23x slower at 16 rows, 0.95x at 32).
# float32 on AVX2 (2 rows per pass there), over a step's 30 layers and LM head: brgemm 1.72x the rows kernel's time
# at 4 rows, 0.71x at 5. float32 on AVX-512 (Ice Lake, 8 rows per pass), summed over the model's layer shapes and
# LM head: brgemm 1.23x the rows kernel's time at 16 rows (two passes), 0.92x at 24 (three, as 17 rows take).
BRGEMM_FROM_ROWS = {
    (torch.bfloat16, "avx512_core_amx"): 5,
    (torch.bfloat16, "avx512_core_bf16"): 32,
    (torch.float32, "avx512_core"): 17,
    (torch.float32, "avx2"): 5,
}

# The kernel builds where activation_dtype auto multiplies float32 activations as int16 at every row count: few rows
# straight from the packed tiles, many through widened panels (the same bits). AVX-512 VNNI (Ice Lake; `pagedllm
# bench kernels`): per layer shape and LM head 0.55-0.75x the rows kernel's time at 1 row, 0.45-0.65x at 5 and 8.
# AVX2 (an AVX2-only EPYC, and the avx2 build on that Ice Lake): 0.55-0.85x at 1 row, 0.35-0.6x at 3, and below brgemm's
# float32 from 1 to 2,048 rows.
INT16_VARIANTS = ("avx2", "avx512vnni")

# The row count from which int8_tiles beats int8 (docs/quantized_matmul.md has the figures). Both give the same
# bits for a row, so this is speed only: batch invariance holds across it.
INT8_TILES_FROM_ROWS = 9


def brgemm_isa(dtype: torch.dtype) -> str | None:
    """The ISA oneDNN's brgemm runs dtype on here (its names), or None where pagedllm does not use it
    (bfloat16 without AVX512-BF16 is emulated: slower than the rows kernel; float16 needs AVX512-FP16)."""
    if kernels.kernels is None or not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return None
    if dtype == torch.bfloat16:
        if torch.cpu._is_amx_tile_supported():
            return "avx512_core_amx"
        return "avx512_core_bf16" if torch.cpu._is_avx512_bf16_supported() else None
    if dtype == torch.float32:
        if torch.cpu._is_avx512_supported():
            return "avx512_core"
        return "avx2" if torch.cpu._is_avx2_supported() else None
    return None


def int16_is_faster(dtype: torch.dtype) -> bool:
    """Whether activation_dtype auto takes the int16 path for dtype: float32 where the kernels are the AVX2 build (a
    CPU without AVX-512), whose int16 products (vpmaddwd: 16 an instruction, then an addition) beat float32's FMAs (8
    an instruction), or the AVX-512 VNNI build (a CPU with VNNI but no BF16), whose vpdpwssd multiplies and adds 32 at
    an FMA's rate of 16: both beat the rows kernel and brgemm's float32 at every row count (docs/quantized_matmul.md)."""
    return dtype == torch.float32 and kernels.kernels is not None and kernels.variant in INT16_VARIANTS


@dataclass(frozen=True)
class Route:
    """The path below `many_from` rows and the path from there on, for one activation dtype."""
    few: str
    many: str
    many_from: int
    isa: str | None   # brgemm's, where it is one of the paths

    def path(self, num_rows: int) -> str:
        """The path for this many rows."""
        return self.many if num_rows >= self.many_from else self.few

    def describe(self) -> str:
        def named(path: str) -> str:
            return f"brgemm (oneDNN {self.isa})" if path == "brgemm" else path
        if self.few == self.many:
            return f"{named(self.few)} for every row count"
        return f"{named(self.few)} below {self.many_from} rows, {named(self.many)} from {self.many_from}"


class QuantizedMatmul:
    """The kernels of one model's quantized layers. batch_invariant: a row's result is bitwise the same whatever
    batch it shares: the rows kernel at every row count (activation_dtype model, or auto where int16 is not the
    default), int16 (always invariant), or int8 and int8_tiles (the same bits per row).
    device: the model's (off CPU every route is torch)."""

    def __init__(self, activation_dtype: str = "auto", batch_invariant: bool = False,
                 device: torch.device = torch.device("cpu")):
        if activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"activation_dtype must be one of {', '.join(ACTIVATION_DTYPES)}, got {activation_dtype!r}")
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        self.activation_dtype, self.batch_invariant, self.device = activation_dtype, batch_invariant, device
        forced = os.environ.get(FORCE_VARIABLE) or None
        if forced is not None and forced not in PATHS:
            raise ValueError(f"{FORCE_VARIABLE} must be one of {', '.join(PATHS)}, got {forced!r}")
        self.routes = {dtype: self._route(dtype, forced) for dtype in _DTYPES}
        self._kernels = {dtype: {path: self._kernel(path) for path in (route.few, route.many)}
                         for dtype, route in self.routes.items()}
        self._bfloat16_brgemm_isa = brgemm_isa(torch.bfloat16)   # where float_sums_kernel's brgemm takes bfloat16

    def _route(self, dtype: torch.dtype, forced: str | None) -> Route:
        isa = brgemm_isa(dtype)
        if forced is not None:
            if forced != "torch" and kernels.kernels is None:
                raise ValueError(f"{FORCE_VARIABLE}={forced}: the C++ kernels are not built")
            if forced == "brgemm" and brgemm_isa(torch.float32) is None:
                raise ValueError(f"{FORCE_VARIABLE}=brgemm: oneDNN's brgemm runs no activation dtype on this CPU")
            if forced == "brgemm" and isa is None:   # float16 anywhere, bfloat16 without AVX512-BF16: the rows kernel
                return Route("rows", "rows", 1, None)
            return Route(forced, forced, 1, isa)
        if kernels.kernels is None or self.device.type != "cpu":
            return Route("torch", "torch", 1, None)
        if self.activation_dtype == "int8":
            return Route("int8", "int8_tiles", INT8_TILES_FROM_ROWS, None)
        # int16 runs every row count, so it is batch-invariant itself (a row's sums ignore the other rows).
        if self.activation_dtype == "int16" or (self.activation_dtype == "auto" and int16_is_faster(dtype)):
            return Route("int16", "int16", 1, None)
        if self.batch_invariant or isa is None:
            return Route("rows", "rows", 1, None)
        return Route("rows", "brgemm", BRGEMM_FROM_ROWS[dtype, isa], isa)

    def kernel(self, dtype: torch.dtype, num_rows: int):
        """The compiled function for this many rows of dtype, or None: dequantize and F.linear."""
        route = self.routes.get(dtype)
        return None if route is None else self._kernels[dtype][route.path(num_rows)]

    def float_sums_kernel(self, dtype: torch.dtype, num_rows: int):
        """For a layer that returns float32 sums (the LM head, its float32 logits): the compiled function for
        this many rows of dtype (or None, as kernel), and the dtype it takes the activations in. The route is
        float32's. Its brgemm takes bfloat16 activations as they are, at twice float32's rate: their products are
        exact in float32 and brgemm sums in float32, so only the weights' rounding to bfloat16 is added (the
        accuracy figures: docs/quantized_matmul.md). Every other path (the rows kernel's few rows, int8, torch)
        takes them widened to float32, exactly."""
        path = self.path(torch.float32, num_rows)
        if dtype == torch.bfloat16 and path == "brgemm" and self._bfloat16_brgemm_isa is not None:
            return self._kernels[torch.float32]["brgemm"], dtype
        return self.kernel(torch.float32, num_rows), torch.float32

    def path(self, dtype: torch.dtype, num_rows: int) -> str:
        """The name of the path `kernel` takes for this many rows of dtype (one of PATHS)."""
        route = self.routes.get(dtype)
        return "torch" if route is None else route.path(num_rows)

    def describe(self, dtype: torch.dtype) -> str:
        route = self.routes.get(dtype)
        text = "torch (weights dequantized per call)" if route is None else route.describe()
        sums = self.routes[torch.float32]
        if dtype == torch.bfloat16 and sums.many == "brgemm" and self._bfloat16_brgemm_isa is not None:
            bfloat16_sums = Route(sums.few, sums.many, sums.many_from, self._bfloat16_brgemm_isa)
            text += f"; into float32 sums (LM head): {bfloat16_sums.describe()} on bfloat16 activations"
        return text

    def _kernel(self, path: str):
        return None if path == "torch" else kernel_for(f"quantized_linear_{path}", self.device)
