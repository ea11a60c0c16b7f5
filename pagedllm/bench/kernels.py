"""`pagedllm bench kernels`: each quantized matmul path against the float layer, per layer shape and row count;
with --attention, each prefill attention path (tiles, brgemm: model/attention/prefill_path.py) per prompt length,
and decode attention per context length.

For each of the model's layer shapes, weight format and row count, times every compiled path this CPU
runs (quantized_matmul.py: rows, brgemm, int8, int8_tiles) and the float layer the model would otherwise run
(Linear: prepacked oneDNN on CPU, in bfloat16 where the CPU has it fast), all in the same run, and names
the path the engine chose for that row count (PAGEDLLM_MATMUL_PATH, if set, forces it). The header says which oneDNN ISA brgemm and the float
layer run on: oneDNN's own start-up line (ONEDNN_VERBOSE, read from a child process) and the ISA
pagedllm derived from the CPU's features; the attention table's header says the same of the brgemm path.
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
    parser.add_argument("--attention", action="store_true",
                        help="time the attention kernels (--dtype's model, --kv-cache-dtype's cache, the model's "
                             "heads) instead of the matmuls")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="--attention: the KV cache's dtype (auto: the engine's choice for --dtype on this CPU, "
                             "e.g. bfloat16 under a float32 model it chose itself)")
    parser.add_argument("--prompt-lens", default="128,512,1024",
                        help="--attention: comma-separated prompt lengths (one whole prompt per call)")
    parser.add_argument("--decode-contexts", default="128,512,2048",
                        help="--attention: comma-separated context lengths of the decode table")
    parser.add_argument("--decode-sequences", type=int, default=64,
                        help="--attention: sequences in each decode call (one query token each)")
    parser.add_argument("--block-size", type=int, default=16, help="--attention: KV block size")


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


# The same for the brgemm attention path: one call of its kernel.
_ATTENTION_PROBE = """
import torch
from pagedllm.model.kernels import kernels
q = torch.randn(32, 2, 64, dtype=torch.{dtype})
k_cache, v_cache = torch.randn(2, 1, 64, 16, dtype=torch.{dtype}), torch.randn(2, 1, 16, 64, dtype=torch.{dtype})
kernels.prefill_attention_brgemm(torch.empty_like(q), q, k_cache, v_cache, None, None, torch.tensor([[0, 1]]),
                                 torch.tensor([0, 32]), torch.tensor([0]), 0.125)
"""


def onednn_lines(dtype: str, path: str, probe: str = _VERBOSE_PROBE) -> list[str]:
    """oneDNN's verbose lines naming the ISA and the implementations it ran (empty if it printed none)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "PAGEDLLM_MATMUL_PATH": path}
    run = subprocess.run([sys.executable, "-c", probe.format(dtype=dtype)], env=env, capture_output=True,
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
    from pagedllm.config.resolve import resolve_dtype, resolve_kv_cache_dtype
    from pagedllm.model import kernels, linear
    from pagedllm.model.loader import load_checkpoint
    from pagedllm.model.quantization import quantize
    from pagedllm.model.quantized_matmul import QuantizedMatmul, brgemm_isa

    if kernels.kernels is None:
        raise SystemExit("the C++ kernels are not built: nothing to measure")
    config = load_checkpoint(args.model).config
    dtype = resolve_dtype(args.dtype, None, torch.device("cpu"))
    if args.attention:
        cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype, dtype, torch.device("cpu"))
        attention_table(config, dtype, cache_dtype, [int(n) for n in args.prompt_lens.split(",")], args.block_size,
                        args.min_time)
        decode_attention_table(config, dtype, cache_dtype, [int(n) for n in args.decode_contexts.split(",")],
                               args.decode_sequences, args.block_size, args.min_time)
        return
    dtype_name = str(dtype).removeprefix("torch.")
    shapes = layer_matmul_shapes(config) + [(config.vocab_size, config.hidden_size)]
    rows_list = [int(r) for r in args.rows.split(",")]
    chosen = QuantizedMatmul()
    paths = ["rows", "int8", "int8_tiles", "int16"] + (["brgemm"] if brgemm_isa(dtype) else [])
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


def cache_label(dtype, cache_dtype) -> str:
    names = [str(d).removeprefix("torch.") for d in (dtype, cache_dtype)]
    return f"{names[0]} model and cache" if dtype == cache_dtype else f"{names[0]} model, {names[1]} cache"


def attention_table(config, dtype, cache_dtype, prompt_lens: list[int], block_size: int, min_time: float) -> None:
    """Each prefill attention path's time for one whole prompt of each length, the model's heads, K/V in shuffled
    blocks of a cache of cache_dtype; GFLOP/s counts the causal products (4 * heads * head_dim per query-key
    pair a query sees). The brgemm path runs bfloat16 and float32 (prefill_path.brgemm_operands)."""
    import torch

    from pagedllm.model import kernels
    from pagedllm.model.attention.cache import kv_cache_shapes
    from pagedllm.model.attention.prefill_path import BRGEMM_OP, PrefillPath, brgemm_operands, choose_prefill_path
    from pagedllm.model.quantized_matmul import brgemm_isa

    operands = brgemm_operands(dtype, cache_dtype)
    isa = brgemm_isa(operands) if operands is not None else None
    paths = [PrefillPath("tiles")] + ([PrefillPath("brgemm", isa)] if isa else [])
    engine_path = choose_prefill_path(dtype, cache_dtype)
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    print(f"prefill attention: CPU kernels {kernels.variant}, {cache_label(dtype, cache_dtype)}, {heads} heads on "
          f"{kv_heads} kv heads of {head_dim}, blocks of {block_size}, {torch.get_num_threads()} threads; brgemm's ISA "
          f"(from the CPU's features): {isa or 'not used'}; engine's choice: {engine_path.describe()}")
    if isa:
        for line in onednn_lines(str(operands).removeprefix("torch."), "rows", _ATTENTION_PROBE):
            print(f"  oneDNN: {line}")
    print(f"| prompt | {' | '.join(f'{path.name} ms' for path in paths)} | "
          f"{' | '.join(f'{path.name} GFLOP/s' for path in paths)} | fastest | chosen |")
    print("|---|" + "---|" * (2 * len(paths) + 2))
    generator = torch.Generator().manual_seed(0)
    for length in prompt_lens:
        num_blocks = -(-length // block_size)
        k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
        k_cache, v_cache = (torch.randn(shape, generator=generator).to(cache_dtype) for shape in (k_shape, v_shape))
        table = torch.randperm(num_blocks, generator=generator)[None]
        q = torch.randn(length, heads, head_dim, generator=generator).to(dtype)
        out = torch.empty_like(q)
        starts, contexts = torch.tensor([0, length]), torch.tensor([0])

        def call(path: PrefillPath):
            kernel = getattr(kernels.kernels, path.op_for(length))
            return lambda: kernel(out, q, k_cache, v_cache, None, None, table, starts, contexts, head_dim ** -0.5)

        times = {path.name: _seconds_per_call(call(path), min_time) for path in paths}
        flops = 4 * heads * head_dim * length * (length + 1) / 2
        chosen = "brgemm" if engine_path.op_for(length) == BRGEMM_OP else "tiles"
        print(f"| {length} | " + " | ".join(f"{seconds * 1e3:.3f}" for seconds in times.values()) + " | "
              + " | ".join(f"{flops / seconds / 1e9:.0f}" for seconds in times.values())
              + f" | {min(times, key=times.get)} | {chosen} |")


def decode_attention_table(config, dtype, cache_dtype, contexts: list[int], sequences: int, block_size: int,
                           min_time: float) -> None:
    """Decode attention's time for `sequences` query tokens, each over its own context of each length (the
    model's heads, K/V in shuffled blocks of a cache of cache_dtype), and the K/V bytes it read per second:
    a decode step reads each cached element once, so memory bandwidth is its bound."""
    import torch

    from pagedllm.model import kernels
    from pagedllm.model.attention.cache import kv_cache_shapes

    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    print(f"\ndecode attention: CPU kernels {kernels.variant}, {cache_label(dtype, cache_dtype)}, "
          f"{sequences} sequences, blocks of {block_size}, {torch.get_num_threads()} threads")
    print("| context | ms | K/V GB/s |")
    print("|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for context in contexts:
        blocks_per_sequence = -(-context // block_size)
        k_shape, v_shape = kv_cache_shapes(sequences * blocks_per_sequence, block_size, kv_heads, head_dim)
        k_cache, v_cache = (torch.randn(shape, generator=generator).to(cache_dtype) for shape in (k_shape, v_shape))
        tables = torch.randperm(sequences * blocks_per_sequence, generator=generator).view(sequences, -1)
        q = torch.randn(sequences, heads, head_dim, generator=generator).to(dtype)
        out = torch.empty_like(q)
        rows, lens = torch.arange(sequences), torch.full((sequences,), context)
        seconds = _seconds_per_call(
            lambda: kernels.kernels.paged_attention(out, q, k_cache, v_cache, None, None, tables, rows, lens,
                                                    head_dim ** -0.5, 0, 0.0), min_time)
        kv_bytes = 2 * sequences * context * kv_heads * head_dim * k_cache.element_size()
        print(f"| {context} | {seconds * 1e3:.3f} | {kv_bytes / seconds / 1e9:.1f} |")
