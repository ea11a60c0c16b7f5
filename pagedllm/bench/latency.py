"""`pagedllm bench latency`: batches of fixed input/output length, timed over several iterations.

Reports the prefill time of the batch and the per-token decode time (p50/p99 over
every decode step of every measured iteration), for each batch size and quantization asked
for, side by side in one run.
"""
from __future__ import annotations

import argparse
import statistics

from pagedllm.bench.scheduling import percentile
from pagedllm.bench.workload import random_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--batch-size", default="8", help="comma-separated for a sweep, e.g. 1,4,16,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto",
                        help="comma-separated values (e.g. none,auto): measured side by side in this run")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM

    batch_sizes = [int(size) for size in args.batch_size.split(",")]
    print(f"input {args.input_len}, output {args.output_len}, KV cache {args.kv_cache_dtype}, "
          f"tensor parallel {args.tensor_parallel_size}, {args.num_iters} iterations")
    print("| quantization | dtype | batch | prefill ms p50 | p99 | decode step ms p50 | p99 | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for quantization in args.quantization.split(","):
        llm = LLM(args.model, dtype=args.dtype, quantization=quantization, kv_cache_dtype=args.kv_cache_dtype,
                  block_size=args.block_size, tensor_parallel_size=args.tensor_parallel_size,
                  enable_prefix_caching=False, max_num_seqs=max(batch_sizes),
                  max_num_batched_tokens=max(2048, max(batch_sizes) * args.input_len))
        for batch_size in batch_sizes:
            prefills, decodes = measure(llm, args, batch_size)
            decode = statistics.median(decodes)
            print(f"| {quantization} | {str(llm.llm_engine.dtype).removeprefix('torch.')} | {batch_size} "
                  f"| {statistics.median(prefills) * 1e3:.1f} | {percentile(prefills, 0.99) * 1e3:.1f} "
                  f"| {decode * 1e3:.1f} | {percentile(decodes, 0.99) * 1e3:.1f} | {batch_size / decode:.1f} |")
        llm.llm_engine.shutdown()
        del llm


def measure(llm, args: argparse.Namespace, batch_size: int) -> tuple[list[float], list[float]]:
    """Prefill times of the batch and every decode step's time, over the measured iterations."""
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prefills, decodes = [], []
    for iteration in range(args.num_iters_warmup + args.num_iters):
        workload = random_workload(num=batch_size, in_min=args.input_len, in_max=args.input_len,
                                   vocab=engine.model_config.vocab_size, seed=iteration)
        for index, item in enumerate(workload):
            engine.add_request(f"{batch_size}-{iteration}-{index}", {"prompt_token_ids": item.prompt_token_ids},
                               params)
        step_times = []
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.last_step_stats
            step_times.append(stats.scheduling_seconds + stats.prepare_seconds + stats.model_seconds)
        if iteration >= args.num_iters_warmup:
            prefills.append(step_times[0])
            decodes.extend(step_times[1:])
    return prefills, decodes
