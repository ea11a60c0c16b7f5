"""`pagedllm bench sweep`: throughput and KV waste by block size on one workload.

A bigger block means fewer, larger KV reads per step, but more slots reserved and
never filled at the end of each sequence. Writes a table and a PNG plot.
"""
from __future__ import annotations

import argparse

from pagedllm.bench.simulate import simulate
from pagedllm.bench.throughput import run_pagedllm
from pagedllm.bench.workload import add_workload_arguments, workload_from_args

BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    add_workload_arguments(parser)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    parser.add_argument("--plot", default="block_size_sweep.png")


def run(args: argparse.Namespace) -> None:
    workload = workload_from_args(args)
    rows = []
    for block_size in args.block_sizes:
        options = argparse.Namespace(**vars(args), block_size=block_size, max_num_seqs=256,
                                     max_num_batched_tokens=None, kv_cache_memory=None, trace=None,
                                     profile_attention=False, repeats=1, prefix_caching=True)
        figures = run_pagedllm(options, workload, quantization="auto", kv_cache_dtype="auto", activation_dtype="auto",
                               cascade="off", adapters=[])
        waste = 1 - simulate(workload, num_blocks=2**20 // block_size, block_size=block_size).utilization
        rows.append((block_size, figures["output_tokens_per_s"], waste))
    print(f"{len(workload)} requests; KV waste = slots held but empty, averaged over steps")
    print("| block size | output tok/s | KV waste |")
    print("|---|---|---|")
    for block_size, throughput, waste in rows:
        print(f"| {block_size} | {throughput} | {waste:.1%} |")
    _plot(rows, args.plot)
    print(f"plot: {args.plot}")


def _plot(rows: list[tuple[int, float, float]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r[0] for r in rows]
    figure, throughput_axis = plt.subplots(figsize=(6, 3.5))
    throughput_axis.plot(sizes, [r[1] for r in rows], "o-", color="tab:blue")
    throughput_axis.set_xscale("log", base=2)
    throughput_axis.set_xticks(sizes, [str(s) for s in sizes])
    throughput_axis.set_xlabel("block size (tokens)")
    throughput_axis.set_ylabel("output tokens / s", color="tab:blue")
    waste_axis = throughput_axis.twinx()
    waste_axis.plot(sizes, [100 * r[2] for r in rows], "s--", color="tab:red")
    waste_axis.set_ylabel("KV waste (%)", color="tab:red")
    figure.suptitle("pagedllm: block size trade-off")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
