"""`pagedllm bench latency`: one batch of fixed input/output length, timed over several iterations.

Reports the prefill time of the batch and the per-token decode time (p50/p99 over
every decode step of every measured iteration).
"""
from __future__ import annotations

import argparse
import statistics

from pagedllm.bench.scheduling import percentile
from pagedllm.bench.workload import random_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
              enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.batch_size * args.input_len))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prefills, decodes = [], []
    for iteration in range(args.num_iters_warmup + args.num_iters):
        workload = random_workload(num=args.batch_size, in_min=args.input_len, in_max=args.input_len,
                                   vocab=engine.model_config.vocab_size, seed=iteration)
        for index, item in enumerate(workload):
            engine.add_request(f"{iteration}-{index}", {"prompt_token_ids": item.prompt_token_ids}, params)
        step_times = []
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.last_step_stats
            step_times.append(stats.scheduling_seconds + stats.model_seconds)
        if iteration >= args.num_iters_warmup:
            prefills.append(step_times[0])
            decodes.extend(step_times[1:])
    print(f"batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
          f"dtype {str(engine.dtype).removeprefix('torch.')}, "
          f"KV cache {str(engine.kv_cache_dtype).removeprefix('torch.')}, {args.num_iters} iterations")
    print("| figure | p50 | p99 |")
    print("|---|---|---|")
    print(f"| prefill of the batch, ms | {statistics.median(prefills) * 1e3:.1f} "
          f"| {percentile(prefills, 0.99) * 1e3:.1f} |")
    print(f"| decode step (one token per sequence), ms | {statistics.median(decodes) * 1e3:.1f} "
          f"| {percentile(decodes, 0.99) * 1e3:.1f} |")
