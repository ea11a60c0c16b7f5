"""Where a many-row step's time goes, the quantized default against `quantization=none` (issue 26): the bundled
GGUF, each engine built as `pagedllm bench latency --batch-size 1,16,64,256 --input-len 128` builds it.

For each engine: a warm-up (16 prompts), then torch.profiler over one prefill step of `--prefill-batch` prompts of
128 tokens and over `--decode-steps` decode steps of `--decode-batch` sequences. Prints each profile's operators by
self CPU time (split by input shape, so each layer shape's matmul stands apart), the step's wall time as the engine
times it, and what of it no operator covers (Python, scheduling). Run it in a benchmark window:
`python scripts/profile_many_rows.py` (`--quantizations auto` for one engine).
"""
import argparse
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workload import random_workload

INPUT_LEN = 128


def add_requests(engine, tag: str, batch: int, max_tokens: int, seed: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index, item in enumerate(random_workload(num=batch, in_min=INPUT_LEN, in_max=INPUT_LEN,
                                                 vocab=engine.model_config.vocab_size, seed=seed)):
        engine.add_request(f"{tag}-{index}", {"prompt_token_ids": item.prompt_token_ids}, params)


def step_seconds(engine) -> float:
    stats = engine.last_step_stats
    return stats.scheduling_seconds + stats.prepare_seconds + stats.model_seconds


def print_profile(title: str, profiler, wall: float, steps: int, top: int) -> None:
    averages = profiler.key_averages(group_by_input_shape=True)
    rows = sorted(averages, key=lambda event: -event.self_cpu_time_total)
    covered = sum(event.self_cpu_time_total for event in profiler.key_averages()) / 1e6
    print(f"\n=== {title}: {wall * 1e3:.1f} ms wall over {steps} step(s); operators' self time {covered * 1e3:.1f} ms "
          f"(the rest, {max(0.0, wall - covered) * 1e3:.1f} ms, outside operators)")
    print("| operator | input shapes | calls | self ms per step |")
    print("|---|---|---|---|")
    for event in rows[:top]:
        print(f"| {event.key} | {str(event.input_shapes)[:90]} | {event.count} "
              f"| {event.self_cpu_time_total / 1e3 / steps:.2f} |")


def profile_engine(quantization: str, args: argparse.Namespace) -> None:
    llm = LLM(quantization=quantization, enable_prefix_caching=False, max_num_seqs=args.prefill_batch,
              max_num_batched_tokens=max(2048, args.prefill_batch * INPUT_LEN))
    engine = llm.llm_engine
    print(f"\n##### quantization={quantization}, dtype {engine.dtype}, {torch.get_num_threads()} threads")
    add_requests(engine, "warm", 16, 2, seed=100)
    while engine.has_unfinished_requests():
        engine.step()

    add_requests(engine, "prefill", args.prefill_batch, 1, seed=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        started = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - started
    print(f"prefill of {args.prefill_batch} x {INPUT_LEN}: engine's step time {step_seconds(engine) * 1e3:.1f} ms")
    print_profile(f"prefill, {args.prefill_batch} x {INPUT_LEN} tokens", profiler, wall, 1, args.top)
    while engine.has_unfinished_requests():
        engine.step()

    add_requests(engine, "decode", args.decode_batch, args.decode_steps + 2, seed=2)
    engine.step()   # the prefill
    engine.step()   # one decode step unprofiled
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        started = time.perf_counter()
        times = []
        for _ in range(args.decode_steps):
            engine.step()
            times.append(step_seconds(engine))
        wall = time.perf_counter() - started
    times.sort()
    print(f"decode at {args.decode_batch} rows: engine's step time p50 {times[len(times) // 2] * 1e3:.1f} ms")
    print_profile(f"decode, {args.decode_batch} rows", profiler, wall, args.decode_steps, args.top)
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantizations", default="auto,none")
    parser.add_argument("--prefill-batch", type=int, default=256)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for quantization in args.quantizations.split(","):
        profile_engine(quantization, args)


if __name__ == "__main__":
    main()
