"""`pagedllm bench multi-turn`: N conversations of M turns, each turn resending the whole history plus a new
question, with the RAM pool sized to a fraction of the workload's KV working set (default 1/4), the KV disk
tier off and on side by side in one run. Reports TTFT p50 / p99 (all of a turn's requests arrive at once),
output tokens/s, prompt tokens found in the prefix cache, and blocks read back from disk. With
--data-parallel-size N > 1 the rows are Ray replica routings instead (--data-parallel-routing, each replica with
that RAM pool, no disk tier): the prefix hit rate and TTFT of prefix-aware routing against least-loaded.

More cases follow: a restart (one long prompt's TTFT cold, then in a new engine on the same --kv-cache-dir),
and preemption of long contexts under each --preemption-modes, with the tokens each recomputed: requests whose
decoding outgrows a small pool, then requests preempted late, with their whole prompts computed, by
higher-priority ones whose prefill takes their blocks.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time

from pagedllm.bench.scheduling import percentile
from pagedllm.config import PREEMPTION_MODES


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
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="above 1: that many Ray engine replicas, one row per --data-parallel-routing")
    parser.add_argument("--data-parallel-routing", default=None,
                        help="comma-separated routings to compare, with --data-parallel-size > 1 "
                             "(default: prefix,least-loaded)")
    parser.add_argument("--restart-prompt-len", type=int, default=4000,
                        help="the restart case's prompt, in tokens (0: skip the case)")
    parser.add_argument("--preemption-modes", default="recompute,swap,auto",
                        help="comma-separated preemption modes to compare (empty: skip the case)")
    parser.add_argument("--preempt-requests", type=int, default=4, help="long requests decoding at once")
    parser.add_argument("--preempt-prompt-len", type=int, default=2048, help="tokens of each long request's prompt")
    parser.add_argument("--preempt-output-len", type=int, default=128, help="tokens each long request decodes")
    parser.add_argument("--preempt-step-tokens", type=int, default=512,
                        help="the late-preemption case's token budget per step (its prefill chunks)")


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker.model_runner import kv_bytes_per_block

    if not 0 < args.ram_fraction <= 1:
        raise ValueError(f"--ram-fraction must be in (0, 1], got {args.ram_fraction}")
    if args.data_parallel_routing is not None and args.data_parallel_size <= 1:
        raise ValueError("--data-parallel-routing compares replica routings: it needs --data-parallel-size > 1, "
                         f"got {args.data_parallel_size}")
    modes = [mode for mode in args.preemption_modes.split(",") if mode]
    if any(mode not in PREEMPTION_MODES for mode in modes):
        raise ValueError(f"--preemption-modes must name modes among {', '.join(PREEMPTION_MODES)}, "
                         f"got {args.preemption_modes!r}")
    probe = LLM(args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory="1MiB").llm_engine
    block_bytes = kv_bytes_per_block(probe.model_config, args.block_size, probe.kv_cache_dtype)
    vocab_size = probe.model_config.vocab_size
    history_len = args.system_len + (args.turns - 1) * args.question_len + args.turns * args.output_len
    working_set_blocks = args.conversations * -(-history_len // args.block_size)
    pool_blocks = max(-(-(history_len + 1) // args.block_size), int(working_set_blocks * args.ram_fraction))
    print(f"{args.conversations} conversations x {args.turns} turns, history up to {history_len} tokens; KV working "
          f"set {working_set_blocks} blocks, RAM pool {pool_blocks} blocks of {args.block_size} tokens")
    if args.data_parallel_size > 1:
        _compare_routings(args, pool_blocks * block_bytes, vocab_size)
        return
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
    if args.restart_prompt_len:
        _restart_case(args, block_bytes, vocab_size)
    if modes:
        _preemption_case(args, modes, block_bytes, vocab_size)
        _late_preemption_case(args, modes, block_bytes, vocab_size)


def _restart_case(args: argparse.Namespace, block_bytes: int, vocab_size: int) -> None:
    """One long prompt cold, evicted to disk by another as long, then the first again in a new engine on the
    same directory: its TTFT there against the cold one."""
    from pagedllm import LLM, SamplingParams

    rng = random.Random(args.seed + 1)
    pool_blocks = -(-(args.restart_prompt_len + 1) // args.block_size)   # the prompt and its token
    prompt = [rng.randrange(vocab_size) for _ in range(args.restart_prompt_len)]
    other = [rng.randrange(vocab_size) for _ in range(pool_blocks * args.block_size - 1)]   # takes every block
    params = SamplingParams(temperature=0, max_tokens=1)
    print(f"\nRestart: a {args.restart_prompt_len}-token prompt, cold, then after a restart on the same --kv-cache-dir")
    print("| case | TTFT ms | disk hit blocks |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for case in ("cold", "after restart"):
            llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=pool_blocks * block_bytes,
                      kv_cache_dir=scratch)
            started = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            ttft = time.perf_counter() - started   # one output token: the request's time is its TTFT
            hits = llm.llm_engine.stats().kv_disk.hit_blocks
            llm.generate({"prompt_token_ids": other}, params, use_tqdm=False)   # spills the prompt's blocks
            llm.llm_engine.shutdown()   # writes every spilled block
            print(f"| {case} | {ttft * 1e3:.1f} | {hits} |")


def _preemption_case(args: argparse.Namespace, modes: list[str], block_bytes: int, vocab_size: int) -> None:
    """Long requests decoding together in a pool that holds their prompts but not their outputs, so the latest
    are preempted; the same workload under each mode."""
    from pagedllm import LLM, SamplingParams

    rng = random.Random(args.seed + 2)
    prompts = [[rng.randrange(vocab_size) for _ in range(args.preempt_prompt_len)] for _ in range(args.preempt_requests)]
    size = args.block_size
    # Room for every prompt and one block more each, so all are admitted while the first decode; their next
    # blocks then do not fit, and the latest is preempted.
    pool_blocks = max(-(-(args.preempt_prompt_len + args.preempt_output_len) // size),
                      args.preempt_requests * (-(-args.preempt_prompt_len // size) + 1) + 1)
    computed_once = args.preempt_requests * (args.preempt_prompt_len + args.preempt_output_len - 1)
    params = SamplingParams(temperature=0, max_tokens=args.preempt_output_len, ignore_eos=True)
    print(f"\nPreemption: {args.preempt_requests} requests of {args.preempt_prompt_len} prompt tokens decoding "
          f"{args.preempt_output_len} each in a pool of {pool_blocks} blocks")
    print("| preemption mode | seconds | output tok/s | preemptions | swapped | tokens recomputed |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        llm = LLM(args.model, dtype=args.dtype, block_size=size, kv_cache_memory=pool_blocks * block_bytes,
                  preemption_mode=mode)
        computed = []
        llm.llm_engine.step_listeners.append(lambda step: computed.append(step.num_tokens))
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
        _print_mode_row(mode, llm.llm_engine, time.perf_counter() - started,
                        args.preempt_requests * args.preempt_output_len, sum(computed) - computed_once)


def _late_preemption_case(args: argparse.Namespace, modes: list[str], block_bytes: int, vocab_size: int) -> None:
    """Long requests preempted after their prompts are computed (scheduling_policy priority): half of
    --preempt-requests decode at a low priority, then as many of the same length arrive at a higher one. The pool
    holds the low ones' whole lives and one prefill chunk more, so the high ones' chunks preempt the low ones
    and take their freed blocks, evicting their cached prefixes: recompute prefills most of each context again
    when they resume, swap copies it back."""
    from pagedllm import LLM, SamplingParams

    rng = random.Random(args.seed + 3)
    num_low = max(1, args.preempt_requests // 2)
    prompts = [[rng.randrange(vocab_size) for _ in range(args.preempt_prompt_len)] for _ in range(2 * num_low)]
    size, chunk = args.block_size, args.preempt_step_tokens
    pool_blocks = num_low * -(-(args.preempt_prompt_len + args.preempt_output_len) // size) + -(-chunk // size) + 1
    computed_once = 2 * num_low * (args.preempt_prompt_len + args.preempt_output_len - 1)
    params = SamplingParams(temperature=0, max_tokens=args.preempt_output_len, ignore_eos=True)
    print(f"\nPreemption late: {num_low} requests of {args.preempt_prompt_len} prompt tokens decoding "
          f"{args.preempt_output_len} each at a low priority, then {num_low} more at a high one, in a pool of "
          f"{pool_blocks} blocks, {chunk} tokens a step")
    print("| preemption mode, late | seconds | output tok/s | preemptions | swapped | tokens recomputed |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        llm = LLM(args.model, dtype=args.dtype, block_size=size, kv_cache_memory=pool_blocks * block_bytes,
                  preemption_mode=mode, scheduling_policy="priority", max_num_batched_tokens=chunk)
        engine = llm.llm_engine
        computed = []
        engine.step_listeners.append(lambda step: computed.append(step.num_tokens))
        started = time.perf_counter()
        for index in range(num_low):
            engine.add_request(f"low{index}", {"prompt_token_ids": prompts[index]}, params, priority=1)
        decoding: set[str] = set()
        while len(decoding) < num_low:   # every low one has its prompt computed and its first token
            decoding.update(output.request_id for output in engine.step() if output.outputs[0].token_ids)
        for index in range(num_low, 2 * num_low):
            engine.add_request(f"high{index}", {"prompt_token_ids": prompts[index]}, params, priority=0)
        while engine.has_unfinished_requests():
            engine.step()
        _print_mode_row(mode, engine, time.perf_counter() - started, 2 * num_low * args.preempt_output_len,
                        sum(computed) - computed_once)


def _print_mode_row(mode: str, engine, seconds: float, num_output_tokens: int, recomputed: int) -> None:
    """One preemption mode's row (seconds, output tok/s, preemptions, swaps, tokens recomputed); shuts the engine
    down."""
    stats = engine.stats()
    swapped = stats.kv_swap.swap_outs if stats.kv_swap is not None else 0
    print(f"| {mode} | {seconds:.2f} | {num_output_tokens / seconds:.1f} | {stats.num_preemptions} | {swapped} "
          f"| {recomputed} |")
    engine.shutdown()


def _conversation_turns(args: argparse.Namespace, vocab_size: int):
    """(turn, histories) for each turn: random first prompts, then a new random question on each history; the
    caller appends each answer to its history before asking for the next turn."""
    rng = random.Random(args.seed)
    histories = [[rng.randrange(vocab_size) for _ in range(args.system_len)] for _ in range(args.conversations)]
    for turn in range(args.turns):
        if turn:
            for history in histories:
                history.extend(rng.randrange(vocab_size) for _ in range(args.question_len))
        yield turn, histories


def _compare_routings(args: argparse.Namespace, kv_cache_memory: int, vocab_size: int) -> None:
    from pagedllm import SamplingParams
    from pagedllm.config import EngineConfig
    from pagedllm.engine.data_parallel import DPAsyncLLM

    routings = (args.data_parallel_routing or "prefix,least-loaded").split(",")
    print(f"{args.data_parallel_size} Ray engine replicas, each with that RAM pool")
    print("| routing | TTFT ms p50 | p99 | output tok/s | prefix-hit prompt tokens | prefix hit rate "
          "| routed for a prefix |")
    print("|---|---|---|---|---|---|---|")
    for routing in routings:
        config = EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                              kv_cache_memory=kv_cache_memory, data_parallel_size=args.data_parallel_size,
                              data_parallel_routing=routing)
        llm = DPAsyncLLM.from_config(config)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        ttfts, tokens_per_second, stats = asyncio.run(_serve_conversations(llm, args, vocab_size, params))
        kv = stats.kv_cache
        routed = sum(reasons["prefix"] for reasons in stats.data_parallel.routed.values())
        print(f"| {routing} | {statistics.median(ttfts) * 1e3:.1f} | {percentile(ttfts, 0.99) * 1e3:.1f} "
              f"| {tokens_per_second:.1f} | {kv.prefix_cache_hits} | {kv.prefix_cache_hit_rate:.1%} | {routed} |")


async def _serve_conversations(llm, args: argparse.Namespace, vocab_size: int, params):
    """Every turn of every conversation through data-parallel replicas, each turn's requests at once; returns the
    TTFTs, output tokens/s over the whole run and the replicas' combined figures. Shuts the replicas down."""
    async def ask(history: list[int], request_id: str) -> tuple[float, list[int]]:
        arrived, first_token, final = time.perf_counter(), None, None
        async for output in llm.generate({"prompt_token_ids": list(history)}, params, request_id):
            if first_token is None and output.outputs[0].token_ids:
                first_token = time.perf_counter() - arrived
            final = output
        return first_token, final.outputs[0].token_ids

    try:
        ttfts, num_output_tokens, started = [], 0, time.perf_counter()
        for turn, histories in _conversation_turns(args, vocab_size):
            # Each turn's requests arrive in a new order, as users' do: in a fixed one, least-loaded routing would
            # send each conversation to the same replica every turn by position alone.
            order = random.Random(args.seed + turn).sample(range(len(histories)), len(histories))
            answers = await asyncio.gather(*(ask(histories[index], f"c{index}t{turn}") for index in order))
            for history, (ttft, answer) in zip((histories[index] for index in order), answers):
                history.extend(answer)
                ttfts.append(ttft)
                num_output_tokens += len(answer)
        return ttfts, num_output_tokens / (time.perf_counter() - started), await llm.stats()
    finally:
        await llm.shutdown()


def _run_conversations(engine, args: argparse.Namespace, vocab_size: int, sampling_params_class):
    """Every turn of every conversation; returns the TTFTs and output tokens/s over the whole run."""
    params = sampling_params_class(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ttfts, num_output_tokens, started = [], 0, time.perf_counter()
    for turn, histories in _conversation_turns(args, vocab_size):
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
