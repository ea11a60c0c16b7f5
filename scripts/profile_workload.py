"""Where the shared workload's time goes, the quantized default against `quantization=none` (issue 26 item 5).

For each engine (built as `pagedllm bench throughput --no-prefix-caching` builds it): an untimed run of the whole
workload (or of its first `--warmup-prompts` requests), then torch.profiler over one whole run of it. The untimed run
is the one `bench throughput --repeats 2` makes: it writes the KV pages the profiled run reuses. After a warm-up of
16 requests the profiled run wrote most of its KV into pages never written before, and the OS's zeroing of them
showed as `write_kv` time (2.2 of W1's 33.8 s on an AMD EPYC Zen 5, ~1.6 s of it page faults) that the benchmark's
timed run does not pay.

Prints, per engine, the wall time, each operator's self CPU time over the run (the C++ kernels are registered ops
and show by name; the model's labelled ranges, e.g. `pagedllm::decode_attention`, count only their own Python between
the kernels), and what no operator covers (Python, scheduling, sampling's Python); then the operators of both engines
side by side.
Run it in a benchmark window:
`python scripts/profile_workload.py --dataset w1.jsonl` (`w1.jsonl` from `python ../shared/bench/make_workload.py`;
`--num-prompts 64` for its first 64 requests).
"""
import argparse
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workload import add_workload_arguments, workload_from_args


def run_workload(llm, workload) -> None:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
    llm.generate(prompts, params, use_tqdm=False)


def totals(averages, by_shape: bool) -> tuple[dict, dict]:
    """{operator: self seconds} and {operator: calls}, split by input shapes where by_shape."""
    seconds, calls = {}, {}
    for event in averages:
        key = f"{event.key} {str(event.input_shapes)[:70]}" if by_shape else event.key
        seconds[key] = event.self_cpu_time_total / 1e6
        calls[key] = event.count
    return seconds, calls


def profile_engine(quantization: str, workload, args: argparse.Namespace) -> tuple[float, list, list]:
    """The profiled run's wall seconds and its (self seconds, calls) per operator, then per operator and shape."""
    llm = LLM(quantization=quantization, enable_prefix_caching=False, max_num_seqs=args.max_num_seqs)
    run_workload(llm, workload[:args.warmup_prompts])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=args.by_shape) as profiler:
        started = time.perf_counter()
        run_workload(llm, workload)
        wall = time.perf_counter() - started
    by_name = totals(profiler.key_averages(), by_shape=False)
    by_shape = totals(profiler.key_averages(group_by_input_shape=True), by_shape=True) if args.by_shape else None
    llm.llm_engine.shutdown()
    return wall, by_name, by_shape


def print_side_by_side(names: list[str], walls: list[float], tables: list[tuple[dict, dict]], top: int) -> None:
    print(f"\n| part | {' | '.join(f'{name}: self s (calls)' for name in names)} |")
    print(f"|---|{'---|' * len(names)}")
    keys = sorted({key for seconds, _ in tables for key in seconds},
                  key=lambda key: -max(seconds.get(key, 0.0) for seconds, _ in tables))
    for key in keys[:top]:
        cells = [f"{seconds.get(key, 0.0):.2f} ({calls.get(key, 0)})" for seconds, calls in tables]
        print(f"| `{key}` | {' | '.join(cells)} |")
    rest = [sum(seconds[key] for key in keys[top:] if key in seconds) for seconds, _ in tables]
    print(f"| the other operators | {' | '.join(f'{value:.2f}' for value in rest)} |")
    outside = [max(0.0, wall - sum(seconds.values())) for wall, (seconds, _) in zip(walls, tables)]
    print(f"| outside operators (Python, scheduling) | {' | '.join(f'{value:.2f}' for value in outside)} |")
    print(f"| wall | {' | '.join(f'{wall:.2f}' for wall in walls)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--quantizations", default="auto,none")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="as `pagedllm bench throughput`'s default")
    parser.add_argument("--warmup-prompts", type=int, default=None,
                        help="requests of the untimed run before the profiled one (default: the whole workload)")
    parser.add_argument("--by-shape", action="store_true", help="split each operator by its input shapes")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    workload = workload_from_args(args)[:args.num_prompts]   # a dataset file's first --num-prompts requests
    names = args.quantizations.split(",")
    print(f"{len(workload)} requests, {sum(len(r.prompt_token_ids) for r in workload)} prompt + "
          f"{sum(r.max_tokens for r in workload)} output tokens; {torch.get_num_threads()} threads")
    results = []
    for quantization in names:
        results.append(profile_engine(quantization, workload, args))
        wall, (seconds, _), _ = results[-1]
        print(f"quantization={quantization}: {wall:.2f} s wall, operators' self time {sum(seconds.values()):.2f} s")
    labels = [f"quantization={name}" for name in names]
    walls = [wall for wall, _, _ in results]
    print_side_by_side(labels, walls, [by_name for _, by_name, _ in results], args.top)
    if args.by_shape:
        print_side_by_side(labels, walls, [by_shape for _, _, by_shape in results], args.top)


if __name__ == "__main__":
    main()
