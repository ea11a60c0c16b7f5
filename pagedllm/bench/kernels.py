"""`pagedllm bench kernels`: each quantized matmul path against the float layer, per layer shape and row count.

For each of the model's layer shapes, weight format and row count, times every compiled path this CPU
runs (quantized_matmul.py: rows, brgemm, int8) and the float layer the model would otherwise run
(Linear: prepacked oneDNN on CPU, in bfloat16 where the CPU has it fast), all in the same run, and names
the path the engine chose for that row count (PAGEDLLM_MATMUL_PATH, if set, forces it). The header says which oneDNN ISA brgemm and the float
layer run on: oneDNN's own start-up line (ONEDNN_VERBOSE, read from a child process) and the ISA
pagedllm derived from the CPU's features.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="whose layer shapes (default: the bundled model)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256", help="comma-separated row counts")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="activation dtype (auto: the engine's choice on this CPU)")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds each measurement runs")


def _seconds_per_call(fn, min_time: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_time:
        fn()
        calls += 1
    return elapsed / max(calls, 1)


# Run in a child with ONEDNN_VERBOSE=1: one brgemm call and one float layer call, so that oneDNN prints
# the ISA it dispatches to (its "info,cpu,isa" line) and the kernels it generated.
_VERBOSE_PROBE = """
import torch
from pagedllm.model.linear import Linear, QuantizedLinear
from pagedllm.model.quantization import quantize
from pagedllm.model.quantized_matmul import QuantizedMatmul
dtype = getattr(torch, {dtype!r})
weight = torch.randn(64, 256)
x = torch.randn(32, 256).to(dtype)
QuantizedLinear(quantize(weight, 4), matmul=QuantizedMatmul())(x)
Linear(weight.to(dtype))(x)
"""


def onednn_lines(dtype: str, path: str) -> list[str]:
    """oneDNN's verbose lines naming the ISA and the implementations it ran (empty if it printed none)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "PAGEDLLM_MATMUL_PATH": path}
    run = subprocess.run([sys.executable, "-c", _VERBOSE_PROBE.format(dtype=dtype)], env=env, capture_output=True,
                         text=True, timeout=300)
    wanted = ("info,cpu,isa", "brgemm", "exec,cpu,matmul", "exec,cpu,inner_product")
    seen, lines = set(), []
    for line in run.stdout.splitlines():
        if any(key in line for key in wanted):
            key = ",".join(line.split(",")[:6])
            if key not in seen:
                seen.add(key)
                lines.append(line)
    return lines


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.bench.compute_floor import layer_matmul_shapes
    from pagedllm.config.resolve import resolve_dtype
    from pagedllm.model import kernels, linear
    from pagedllm.model.loader import load_checkpoint
    from pagedllm.model.quantization import quantize
    from pagedllm.model.quantized_matmul import QuantizedMatmul, brgemm_isa

    if kernels.kernels is None:
        raise SystemExit("the C++ kernels are not built: nothing to measure")
    config = load_checkpoint(args.model).config
    dtype = resolve_dtype(args.dtype, None, torch.device("cpu"))
    dtype_name = str(dtype).removeprefix("torch.")
    shapes = layer_matmul_shapes(config) + [(config.vocab_size, config.hidden_size)]
    rows_list = [int(r) for r in args.rows.split(",")]
    chosen = QuantizedMatmul()
    paths = ["rows", "int8"] + (["brgemm"] if brgemm_isa(dtype) else [])
    print(f"CPU kernels {kernels.variant}, activations {dtype_name}, {torch.get_num_threads()} threads; "
          f"brgemm's ISA (from the CPU's features): {brgemm_isa(dtype) or 'not used'}; "
          f"engine's choice: {chosen.describe(dtype)}")
    for line in onednn_lines(dtype_name, "brgemm" if "brgemm" in paths else "rows"):
        print(f"  oneDNN: {line}")
    print("ms per call")
    print(f"| out x in | format | rows | {' | '.join(paths)} | float layer | fastest | chosen |")
    print("|---|---|---|" + "---|" * len(paths) + "---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in shapes:
        dense = torch.randn(out_features, in_features, generator=generator) * 0.02
        float_layer = linear.Linear(dense.to(dtype))
        for bits in (4, 8):
            weight = quantize(dense, bits)
            layer = linear.QuantizedLinear(weight)
            for rows in rows_list:
                x = torch.randn(rows, in_features, generator=generator).to(dtype)
                out = x.new_empty(rows, out_features)

                def call(path: str):
                    kernel = getattr(kernels.kernels, f"quantized_linear_{path}")
                    return lambda: kernel(out, x, layer.qweight, layer.scales, layer.mins, None, layer.bits,
                                          layer.group_size)

                times = {path: _seconds_per_call(call(path), args.min_time) for path in paths}
                times["float layer"] = _seconds_per_call(lambda: float_layer(x), args.min_time)
                fastest = min(times, key=times.get)
                engine_path = next(path for path in paths
                                   if chosen.kernel(dtype, rows) is getattr(kernels.kernels, f"quantized_linear_{path}"))
                print(f"| {out_features} x {in_features} | int{bits} | {rows} | "
                      + " | ".join(f"{seconds * 1e3:.3f}" for seconds in times.values())
                      + f" | {fastest} | {engine_path} |")
