"""`pagedllm bench memory`: the PagedAttention memory claims, measured.

(a) KV utilisation by block size against contiguous per-sequence reservations,
(b) blocks held by parallel sampling and beam search with sharing against without,
(c) how many sequences run at once in a fixed KV budget, paged against reserved.
(a) and (c) drive the real scheduler and KV manager without a model (see simulate.py);
(b) runs the bundled model, since forks depend on what the model samples.
"""
from __future__ import annotations

import argparse
import statistics

from pagedllm.bench import kv_trace
from pagedllm.bench.kv_trace import KVTrace, reserved_row
from pagedllm.bench.simulate import simulate
from pagedllm.bench.workload import BenchRequest, add_workload_arguments, workload_from_args
from pagedllm.kv.snapshot import block_codes

BLOCK_SIZES = (8, 16, 32, 64, 128)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="what a contiguous cache reserves per sequence (transformers' static cache)")
    parser.add_argument("--kv-budget-tokens", type=int, default=32768,
                        help="KV budget, in tokens, for the concurrency comparison (c)")
    parser.add_argument("--sharing-prompts", type=int, default=8,
                        help="workload prompts run through the model for (b)")
    parser.add_argument("--sharing-max-tokens", type=int, default=32)
    parser.add_argument("--skip-model", action="store_true", help="skip (b), which loads the bundled model")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also write the block map over time: paged against reserved in the (c) budget, and "
                             "(b)'s n = 4 and beam runs, as a PNG strip and the same data as FILE.json")


def run(args: argparse.Namespace) -> None:
    workload = workload_from_args(args)
    print(f"workload: {len(workload)} requests, {sum(len(r.prompt_token_ids) for r in workload)} prompt + "
          f"{sum(r.max_tokens for r in workload)} output tokens\n")
    traces: dict[str, KVTrace] | None = {} if args.plot else None
    print_utilization(workload, args.max_model_len)
    print_concurrency(workload, args.kv_budget_tokens, args.max_model_len, traces)
    if not args.skip_model:
        print_sharing(workload[:args.sharing_prompts], args.sharing_max_tokens, traces)
    if traces:
        for written in kv_trace.save(args.plot, traces, block_size=16):
            print(f"wrote {written}")


def print_utilization(workload: list[BenchRequest], max_model_len: int) -> None:
    print("(a) KV utilisation (tokens stored / slots held, averaged over steps)")
    print(f"| block size | paged | reserve max_model_len ({max_model_len}) | reserve prompt+max_tokens |")
    print("|---|---|---|---|")
    for block_size in BLOCK_SIZES:
        result = simulate(workload, num_blocks=2**20 // block_size, block_size=block_size)
        print(f"| {block_size} | {result.utilization:.1%} | {result.reserved_utilization(max_model_len):.1%} "
              f"| {result.oracle_utilization:.1%} |")
    print()


def trace_paged_and_reserved(traces: dict[str, KVTrace], num_blocks: int, block_size: int, max_model_len: int):
    """A simulate() step hook that records the paged block map and, beside it, the same running sequences
    in contiguous max_model_len reservations (those that fit)."""
    paged = traces.setdefault(f"paged ({num_blocks} blocks of {block_size})", KVTrace())
    reserved = traces.setdefault(f"reserved max_model_len ({max_model_len})", KVTrace())

    def on_step(kv, scheduler) -> None:
        paged.record(block_codes(kv))
        reserved.rows.append(reserved_row([r.num_computed_tokens for r in scheduler.running], num_blocks,
                                          block_size, max_model_len))
    return on_step


def print_concurrency(workload: list[BenchRequest], budget_tokens: int, max_model_len: int,
                      traces: dict[str, KVTrace] | None = None) -> None:
    print(f"(c) sequences running at once in a {budget_tokens}-token KV budget")
    print("| block size | paged (peak) | paged (mean) | reserve max_model_len | preemptions |")
    print("|---|---|---|---|---|")
    for block_size in (16, 32):
        num_blocks = budget_tokens // block_size
        on_step = (trace_paged_and_reserved(traces, num_blocks, block_size, max_model_len)
                   if traces is not None and block_size == 16 else None)
        result = simulate(workload, num_blocks=num_blocks, block_size=block_size, on_step=on_step)
        mean = result.running_seq_steps / result.steps
        print(f"| {block_size} | {result.peak_running} | {mean:.1f} | {budget_tokens // max_model_len} "
              f"| {result.preemptions} |")
    print()


def print_sharing(workload: list[BenchRequest], max_tokens: int, traces: dict[str, KVTrace] | None = None) -> None:
    from pagedllm import LLM, BeamSearchParams, SamplingParams

    llm = LLM(kv_cache_memory="1GiB")
    engine = llm.llm_engine
    samples: list[tuple[int, int]] = []
    step = engine.step

    def observed_step():
        result = step()
        usage = engine.kv_manager.usage()
        samples.append((usage.num_used_blocks, usage.num_logical_blocks))
        return result

    engine.step = observed_step
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    print(f"(b) KV blocks held with sharing vs without ({len(prompts)} workload prompts, "
          f"{max_tokens} new tokens, block size {engine.kv_manager.block_size})")
    print("| run | blocks with sharing (mean / peak) | without sharing (mean / peak) | saved |")
    print("|---|---|---|---|")
    runs = {
        "parallel sampling, n = 4": lambda: llm.generate(
            prompts, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False),
        "beam search, width 4": lambda: llm.beam_search(
            prompts, BeamSearchParams(beam_width=4, max_tokens=max_tokens, ignore_eos=True)),
    }
    for name, generate in runs.items():
        samples.clear()
        if traces is not None:
            trace = traces[name] = KVTrace(engine.kv_manager)
            engine.step_listeners.append(trace)
        generate()
        if traces is not None:
            engine.step_listeners.remove(trace)
        used = [u for u, _ in samples]
        logical = [n for _, n in samples]
        saved = 1 - statistics.fmean(used) / statistics.fmean(logical)
        print(f"| {name} | {statistics.fmean(used):.0f} / {max(used)} | "
              f"{statistics.fmean(logical):.0f} / {max(logical)} | {saved:.0%} |")
    print()
