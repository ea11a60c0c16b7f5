"""`pagedllm bench scheduling`: time spent per step in the scheduler and KV bookkeeping.

Fills the engine with --num-seqs decoding sequences, then times --steps decode
steps, splitting each into scheduling (scheduler, block tables, prefix hashes,
forks) and model (inputs, forward pass, sampling), as LLMEngine records them.
"""
from __future__ import annotations

import argparse
import statistics

from pagedllm.bench.workload import random_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.num_seqs,
              max_num_batched_tokens=max(2048, args.num_seqs * args.prompt_len))
    engine = llm.llm_engine
    workload = random_workload(num=args.num_seqs, in_min=args.prompt_len, in_max=args.prompt_len,
                               vocab=engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for index, item in enumerate(workload):
        engine.add_request(str(index), {"prompt_token_ids": item.prompt_token_ids}, params)
    while len(engine.scheduler.running) < args.num_seqs or engine.scheduler.waiting:
        engine.step()
    engine.step()   # every sequence past its prefill
    scheduling, model = [], []
    for _ in range(args.steps):
        engine.step()
        stats = engine.last_step_stats
        assert stats.num_seqs == args.num_seqs, "every sequence should decode in every measured step"
        scheduling.append(stats.scheduling_seconds)
        model.append(stats.model_seconds)
    engine.abort_request([str(i) for i in range(args.num_seqs)])
    share = sum(scheduling) / (sum(scheduling) + sum(model))
    print(f"{args.num_seqs} running sequences, {args.steps} decode steps, block size {args.block_size}")
    print("| scheduler + KV bookkeeping per step | median | p99 | share of step time |")
    print("|---|---|---|---|")
    print(f"| ms | {statistics.median(scheduling) * 1e3:.3f} | {percentile(scheduling, 0.99) * 1e3:.3f} "
          f"| {share:.2%} |")
    print(f"(model step: median {statistics.median(model) * 1e3:.1f} ms)")
