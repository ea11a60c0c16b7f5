"""`pagedllm bench scheduling`: time spent per step outside the model.

Fills the engine with --num-seqs decoding sequences, then times --steps decode
steps, splitting each as LLMEngine records them into scheduling (schedule() and
update_from_output(): KV bookkeeping, prefix hashes, stops), step preparation (the
runner's batch update and input arrays and tensors) and model (forward pass, sampling).
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.bench.workload import random_workload
from pagedllm.kv.block_pool import hash_block


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


def seconds_per_block_hash(token_lists: list[list[int]], block_size: int, hash_fn=hash_block,
                           repeats: int = 5) -> float:
    """Time to hash one full block of a chain (parent digest, tokens, no salt), over the workload's blocks;
    the best of a few passes, as timeit does (right after a model step torch's threads still spin)."""
    blocks = [tuple(tokens[start:start + block_size]) for tokens in token_lists
              for start in range(0, len(tokens) - block_size + 1, block_size)]
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        parent = None
        for block in blocks:
            parent = hash_fn(parent, block)
        best = min(best, time.perf_counter() - started)
    return best / len(blocks)


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams

    if args.prompt_len < args.block_size:   # the block-hash figure needs full blocks
        raise ValueError(f"--prompt-len must be >= --block-size ({args.block_size}), got {args.prompt_len}")

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
    parts = {"scheduler + KV bookkeeping": [], "step preparation": [], "both": []}
    model = []
    for _ in range(args.steps):
        engine.step()
        stats = engine.last_step_stats
        assert stats.num_seqs == args.num_seqs, "every sequence should decode in every measured step"
        parts["scheduler + KV bookkeeping"].append(stats.scheduling_seconds)
        parts["step preparation"].append(stats.prepare_seconds)
        parts["both"].append(stats.scheduling_seconds + stats.prepare_seconds)
        model.append(stats.model_seconds)
    engine.abort_request([str(i) for i in range(args.num_seqs)])
    print(f"{args.num_seqs} running sequences, {args.steps} decode steps, block size {args.block_size}")
    print("| per step | median | p99 | share of step time |")
    print("|---|---|---|---|")
    total = sum(parts["both"]) + sum(model)
    for name, seconds in parts.items():
        print(f"| {name} | {statistics.median(seconds) * 1e3:.3f} ms | {percentile(seconds, 0.99) * 1e3:.3f} ms "
              f"| {sum(seconds) / total:.2%} |")
    print(f"(model step: median {statistics.median(model) * 1e3:.1f} ms)")
    prompts = [item.prompt_token_ids for item in workload]
    sha256_seconds = seconds_per_block_hash(prompts, args.block_size)
    builtin_seconds = seconds_per_block_hash(prompts, args.block_size, lambda parent, block: hash((parent, block)))
    per_step = args.num_seqs / args.block_size   # each decoding sequence fills a block every block_size steps
    print(f"prefix-cache block hash (sha256, within the figures above): {sha256_seconds * 1e6:.2f} us per block, "
          f"x {per_step:.0f} blocks filled per decode step = {sha256_seconds * per_step * 1e3:.3f} ms per step "
          f"(Python's hash(), used before: {builtin_seconds * 1e6:.2f} us per block)")
