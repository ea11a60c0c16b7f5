"""`pagedllm bench multi-turn`: N conversations of M turns, each turn resending the whole history plus a new
question, with the RAM pool sized to a fraction of the workload's KV working set (default 1/4), the KV disk
tier off and on side by side in one run. Reports TTFT p50 / p99 (all of a turn's requests arrive at once),
output tokens/s, prompt tokens found in the prefix cache, and blocks read back from disk.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from pagedllm.bench.scheduling import percentile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=1024, help="tokens of each conversation's first prompt")
    parser.add_argument("--question-len", type=int, default=64, help="tokens each later turn adds")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ram-fraction", type=float, default=0.25,
                        help="RAM KV pool as a fraction of the workload's KV working set")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dir", default=None, help="the tier-on run's directory (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker.model_runner import kv_bytes_per_block

    if not 0 < args.ram_fraction <= 1:
        raise ValueError(f"--ram-fraction must be in (0, 1], got {args.ram_fraction}")
    probe = LLM(args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory="1MiB").llm_engine
    block_bytes = kv_bytes_per_block(probe.model_config, args.block_size, probe.kv_cache_dtype)
    vocab_size = probe.model_config.vocab_size
    history_len = args.system_len + (args.turns - 1) * args.question_len + args.turns * args.output_len
    working_set_blocks = args.conversations * -(-history_len // args.block_size)
    pool_blocks = max(-(-(history_len + 1) // args.block_size), int(working_set_blocks * args.ram_fraction))
    print(f"{args.conversations} conversations x {args.turns} turns, history up to {history_len} tokens; KV working "
          f"set {working_set_blocks} blocks, RAM pool {pool_blocks} blocks of {args.block_size} tokens")
    print("| KV disk tier | TTFT ms p50 | p99 | output tok/s | prefix-hit prompt tokens | disk hit blocks |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for tier in ("off", "on"):
            tier_options = {"kv_cache_dir": args.kv_cache_dir or scratch} if tier == "on" else {}
            llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=pool_blocks * block_bytes,
                      **tier_options)
            ttfts, tokens_per_second = _run_conversations(llm.llm_engine, args, vocab_size, SamplingParams)
            stats = llm.llm_engine.stats()
            disk_hits = stats.kv_disk.hit_blocks if stats.kv_disk is not None else 0
            print(f"| {tier} | {statistics.median(ttfts) * 1e3:.1f} | {percentile(ttfts, 0.99) * 1e3:.1f} "
                  f"| {tokens_per_second:.1f} | {stats.kv_cache.prefix_cache_hits} | {disk_hits} |")
            llm.llm_engine.shutdown()


def _run_conversations(engine, args: argparse.Namespace, vocab_size: int, sampling_params_class):
    """Every turn of every conversation; returns the TTFTs and output tokens/s over the whole run."""
    rng = random.Random(args.seed)
    histories = [[rng.randrange(vocab_size) for _ in range(args.system_len)] for _ in range(args.conversations)]
    params = sampling_params_class(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ttfts, num_output_tokens, started = [], 0, time.perf_counter()
    for turn in range(args.turns):
        if turn:
            for history in histories:
                history.extend(rng.randrange(vocab_size) for _ in range(args.question_len))
        arrived = time.perf_counter()
        for index, history in enumerate(histories):
            engine.add_request(f"c{index}t{turn}", {"prompt_token_ids": list(history)}, params)
        first_token: dict[str, float] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.outputs[0].token_ids:
                    first_token.setdefault(output.request_id, time.perf_counter() - arrived)
                if output.finished:
                    index = int(output.request_id[1:output.request_id.index("t")])
                    histories[index].extend(output.outputs[0].token_ids)
                    num_output_tokens += len(output.outputs[0].token_ids)
        ttfts.extend(first_token.values())
    return ttfts, num_output_tokens / (time.perf_counter() - started)
