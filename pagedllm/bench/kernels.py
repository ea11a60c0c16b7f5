"""`pagedllm bench kernels`: the quantized linear kernel against the alternatives, per row count.

For each of the model's layer shapes and each weight format, times (a) the int8 dot-product
kernel that quantized layers run, (b) the weight dequantized by the kernel and a float matmul
(the alternative for prefill-sized batches), and (c) the float layer the model would otherwise
run (prepacked oneDNN in bfloat16 where the CPU has it, F.linear in float32), all in the same run.
"""
from __future__ import annotations

import argparse
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


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.bench.compute_floor import layer_matmul_shapes
    from pagedllm.engine.llm_engine import resolve_dtype
    from pagedllm.model import kernels, linear
    from pagedllm.model.loader import load_checkpoint
    from pagedllm.model.quantization import TILE_ROWS, quantize

    if kernels.kernels is None:
        raise SystemExit("the C++ kernels are not built: nothing to measure")
    config = load_checkpoint(args.model).config
    dtype = resolve_dtype(args.dtype, None, torch.device("cpu"))
    shapes = layer_matmul_shapes(config) + [(config.vocab_size, config.hidden_size)]
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"CPU kernels {kernels.variant}, activations {str(dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads; ms per call")
    print("| out x in | format | rows | dot products | dequantized matmul | float layer | best |")
    print("|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in shapes:
        dense = torch.randn(out_features, in_features, generator=generator) * 0.02
        float_layer = linear.Linear(dense.to(dtype))
        for bits in (4, 8):
            layer = linear.QuantizedLinear(quantize(dense, bits))
            for rows in rows_list:
                x = torch.randn(rows, in_features, generator=generator).to(dtype)
                out = x.new_empty(rows, out_features)

                def dot_products():
                    kernels.kernels.quantized_linear(out, x, layer.qweight, layer.scales, layer.mins, None,
                                                     layer.bits, layer.group_size)

                dense = x.new_empty(layer.qweight.shape[0] * TILE_ROWS, in_features)

                def dequantized_matmul():
                    kernels.kernels.dequantize(dense, layer.qweight, layer.scales, layer.mins, layer.bits,
                                               layer.group_size)
                    return torch.nn.functional.linear(x, dense[:out_features])

                times = {"dot products": _seconds_per_call(dot_products, args.min_time),
                         "dequantized matmul": _seconds_per_call(dequantized_matmul, args.min_time),
                         "float layer": _seconds_per_call(lambda: float_layer(x), args.min_time)}
                best = min(times, key=times.get)
                print(f"| {out_features} x {in_features} | int{bits} | {rows} | "
                      + " | ".join(f"{seconds * 1e3:.3f}" for seconds in times.values()) + f" | {best} |")
