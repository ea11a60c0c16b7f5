"""Linear layers and the token embedding, over float or group-quantized weights.

Float: on CPU, oneDNN matmuls against a pre-reordered (blocked) weight. In bfloat16 (where the CPU has it
fast) they run 1.2-2x faster for the small batches of decode steps than F.linear, which reorders the weight
on every call; results are bitwise the same. In float32 F.linear (MKL) takes its matrix-vector path for one
row and a GEMM that packs the whole weight on every call for 2-9 rows: the LM head of a 135M model took
11.8 ms for 1 row and 20-27 ms for 2-9, prepacked oneDNN 3.5-5.8 ms for any of them (docs/performance.md),
so a speculative verification of 1 + k rows costs what one decode row does. Elsewhere (CUDA) F.linear.

Quantized (quantization.py): the compiled kernel that quantized_matmul.py chose for the activation dtype
and row count (few rows: weights dequantized in registers; many: dequantized tiles through oneDNN's brgemm;
opt-in: int8 activations). Without the kernels (CUDA, no build) the weight is dequantized per call:
correct, not fast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.kernels import kernel_for
from pagedllm.model.quantization import QuantizedWeight, stack_rows
from pagedllm.model.quantized_matmul import QuantizedMatmul

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
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.prepacked = can_prepack(weight.dtype, weight.device)
        if self.prepacked:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT)
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.format = str(weight.dtype).removeprefix("torch.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prepacked:
            return F.linear(x, self.weight, self.bias)
        num_rows = x.shape[0]
        padding = padded_rows(num_rows) - num_rows
        if padding:   # the logits rows; the model pads its batch itself (CausalLM.forward)
            x = F.pad(x, (0, 0, 0, padding))
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out[:num_rows] if padding else out


class QuantizedLinear(nn.Module):
    """out_dtype float32: the kernels' float sums come back unrounded (the LM head: logits rounded to bfloat16 tie
    tokens whose logits differ by less than 1/256 of their size, and greedy then picks the wrong one of them);
    x goes in as QuantizedMatmul.float_sums_kernel says (bfloat16 as it is into brgemm, otherwise widened to
    float32 exactly). None: x's dtype."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 matmul: QuantizedMatmul | None = None, out_dtype: torch.dtype | None = None):
        super().__init__()
        if out_dtype not in (None, torch.float32):
            raise ValueError(f"out_dtype must be None (x's dtype) or torch.float32, got {out_dtype!r}")
        self.matmul = matmul or QuantizedMatmul()
        self.out_dtype = out_dtype
        self.format = weight.source
        self.bits, self.group_size = weight.bits, weight.group_size
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self.register_buffer("bias", bias if bias is None or out_dtype is None else bias.to(out_dtype))

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.mins, self.bits, self.group_size, self.format,
                               self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.out_dtype is None:
            kernel = self.matmul.kernel(x.dtype, x.shape[0])
        else:
            kernel, activation_dtype = self.matmul.float_sums_kernel(x.dtype, x.shape[0])
            x = x.to(activation_dtype)
        if kernel is None:
            return F.linear(x, self.weight.dequantize(x.dtype), self.bias)
        out = x.new_empty(x.shape[0], self.out_features, dtype=self.out_dtype or x.dtype)
        kernel(out, x.contiguous(), self.qweight, self.scales, self.mins, self.bias, self.bits, self.group_size)
        return out


class ConcatLinear(nn.Module):
    """Parts of one fused projection whose weights cannot be stacked (formats differ, as Q4_K_M files
    mix Q4_K and Q6_K): each runs alone and the outputs are joined."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fused_linear(weights: list[torch.Tensor | QuantizedWeight], bias: list[torch.Tensor] | None = None,
                 matmul: QuantizedMatmul | None = None, float_output: bool = False) -> nn.Module:
    """One layer computing the weights' outputs side by side (Q/K/V, gate/up): consecutive weights
    of one format are stacked into one matmul. matmul: the kernels of quantized weights. float_output:
    quantized weights return float32 sums (QuantizedLinear's out_dtype); float weights return their
    matmul's dtype, which oneDNN's bfloat16 matmul rounds to."""
    runs: list[tuple[list, list]] = []   # (weights, biases) that stack
    for weight, part_bias in zip(weights, bias or [None] * len(weights)):
        if runs and _stacking_key(runs[-1][0][0]) == _stacking_key(weight):
            runs[-1][0].append(weight)
            runs[-1][1].append(part_bias)
        else:
            runs.append(([weight], [part_bias]))
    layers = [_stacked(run_weights, run_biases, matmul, float_output) for run_weights, run_biases in runs]
    return layers[0] if len(layers) == 1 else ConcatLinear(layers)


def _stacking_key(weight: torch.Tensor | QuantizedWeight) -> tuple:
    """Equal keys stack. A padded quantized weight (rows not a multiple of 16) would leave a gap in
    the middle of a stack: it runs on its own."""
    if isinstance(weight, torch.Tensor):
        return "float", weight.dtype
    return weight.format, id(weight) if weight.padded else None


def _stacked(weights: list, biases: list, matmul: QuantizedMatmul | None, float_output: bool) -> nn.Module:
    bias = None if biases[0] is None else torch.cat(biases)
    if isinstance(weights[0], torch.Tensor):
        return Linear(torch.cat(weights) if len(weights) > 1 else weights[0], bias)
    return QuantizedLinear(stack_rows(weights) if len(weights) > 1 else weights[0], bias, matmul,
                           torch.float32 if float_output else None)


class Embedding(nn.Module):
    """Token embedding rows; a quantized table is dequantized row by row as tokens look it up (on CPU by the
    compiled dequantize: a decode step's one row took 0.18 ms as the torch formula's ~20 small ops)."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.quantized = isinstance(weight, QuantizedWeight)
        self.table = QuantizedLinear(weight) if self.quantized else None
        self.register_buffer("weight", None if self.quantized else weight)
        self.format = weight.source if self.quantized else str(weight.dtype).removeprefix("torch.")
        self._dequantize = kernel_for("dequantize", weight.qweight.device) if self.quantized else None

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not self.quantized:
            return F.embedding(token_ids, self.weight)
        weight = self.table.weight
        if self._dequantize is None:
            return weight.dequantize_rows(token_ids, self.dtype)
        rows = token_ids.new_empty((len(token_ids), weight.shape[1]), dtype=self.dtype)
        self._dequantize(rows, weight.qweight, weight.scales, weight.mins, weight.bits, weight.group_size,
                         token_ids.contiguous())
        return rows
