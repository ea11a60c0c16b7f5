"""`pagedllm bench cascade`: the shared-prefix (cascade) kernel against the plain decode kernel, per group
size and shared length: where cascade attention starts to pay, and the rule the engine would take from it.

One layer of the bundled model's attention shape (9 query heads on 3 kv heads of 64), decodes whose block
tables share their first blocks and then hold a few blocks of their own; the best of --reps calls each, the two
kernels in turns. The timing is the engine's own start-up measurement (model/cascade_timing.py) over the grid
asked for; `--startup` runs that measurement as the engine does (its grid, its early stops) and says how long it
took.
"""
from __future__ import annotations

import argparse
import time

STARTUP_NOTE = "the engine's start-up grid and early stops"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group-sizes", default="2,4,8,64", help="comma-separated sequences per group")
    parser.add_argument("--shared-lens", default="32,64,128,256,1024", help="comma-separated shared keys")
    parser.add_argument("--own-len", type=int, default=20, help="keys of each sequence's own after the prefix")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="queries")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16", "float8_e5m2", "int8"],
                        help="the KV cache's (auto: --dtype)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the process's, as the engine runs with)")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--startup", action="store_true",
                        help=f"time {STARTUP_NOTE} instead of the grid, and report its cost")


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.model import kernels
    from pagedllm.model.cascade import rule_from_timings
    from pagedllm.model.cascade_timing import AttentionShape, CascadeBench, measure_cascade_rule

    if kernels.kernels is None:
        raise SystemExit("the C++ kernels are not built: nothing to measure")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = AttentionShape(9, 3, 64, dtype, dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype),
                           args.block_size)
    if args.startup:
        measurement = measure_cascade_rule(kernels.kernels, shape)
        timings, source = measurement.timings, f"{STARTUP_NOTE}, {measurement.seconds * 1e3:.0f} ms in all"
    else:
        sizes, lens = ([int(n) for n in text.split(",")] for text in (args.group_sizes, args.shared_lens))
        started = time.perf_counter()
        bench = CascadeBench(kernels.kernels, shape, max(sizes), max(lens), args.own_len)
        timings = [bench.time(size, shared, args.reps) for size in sizes for shared in lens]
        source = f"the grid, best of {args.reps}, {time.perf_counter() - started:.2f} s"
    print(f"CPU kernels {kernels.variant}, {args.dtype} queries, {str(shape.kv_cache_dtype).removeprefix('torch.')} "
          f"KV cache, {torch.get_num_threads()} thread(s), blocks of {args.block_size}, {args.own_len} own keys per "
          f"sequence; plain decode kernel / cascade kernel, µs per call ({source})")
    print("| sequences | shared keys | plain µs | cascade µs | speed-up |")
    print("|---|---|---|---|---|")
    for t in timings:
        print(f"| {t.group_size} | {t.shared_len} | {t.plain_seconds * 1e6:.1f} | {t.cascade_seconds * 1e6:.1f} "
              f"| {t.speed_up:.2f}x |")
    print(f"rule: {rule_from_timings(list(timings)).describe()}")
