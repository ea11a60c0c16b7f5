"""Where a batch-1 decode step's time goes (issue 26): the bundled GGUF with all defaults, 128 random prompt
tokens, 128 greedy output tokens, as `pagedllm bench latency --batch-size 1 --input-len 128 --output-len 128`.

Prints the step's parts as the engine times them (scheduling, the runner's preparation, the forward pass with
sampling) over three requests after a warm-up; torch.profiler's operators over the decode steps of one more
request, the quantized matmuls split by weight shape; the bytes of weights one token reads and this machine's
memory read rate with 1 and 2 threads (a sum over 1 GiB), which together give the bandwidth floor of a step.
Run it in a benchmark window: `python scripts/profile_decode.py`.
"""
import collections
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workload import random_workload
from pagedllm.model.linear import Linear, QuantizedLinear

INPUT_LEN, OUTPUT_LEN = 128, 128


def read_rate(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a sum over a gib-sized float32 tensor reads at, best of repeats."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    data = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    torch.set_num_threads(previous)
    return data.nbytes / best


def weight_bytes_per_token(model: torch.nn.Module) -> dict[str, int]:
    """Bytes each kind of layer reads for one token: every linear layer's weights (the embedding reads one row)."""
    kinds: dict[str, int] = collections.Counter()
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear) and not name.endswith(".table"):
            held = sum(t.nbytes for t in (module.qweight, module.scales, module.mins) if t is not None)
            kinds[f"{name.split('.')[-1] if 'layers' in name else name} {module.format}"] += held
        elif isinstance(module, Linear):
            kinds[f"{name.split('.')[-1]} {module.format}"] += module.weight.nbytes
    return kinds


def main() -> None:
    llm = LLM(enable_prefix_caching=False, max_num_seqs=1)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    parts = collections.defaultdict(list)

    def run(seed: int) -> None:
        item = random_workload(num=1, in_min=INPUT_LEN, in_max=INPUT_LEN, vocab=engine.model_config.vocab_size,
                               seed=seed)[0]
        engine.add_request(f"r{seed}", {"prompt_token_ids": item.prompt_token_ids}, params)
        engine.step()   # the prefill
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            whole = time.perf_counter() - started
            stats = engine.last_step_stats
            parts["scheduling"].append(stats.scheduling_seconds)
            parts["prepare"].append(stats.prepare_seconds)
            parts["model + sampling"].append(stats.model_seconds)
            parts["step (bench latency's sum)"].append(stats.scheduling_seconds + stats.prepare_seconds
                                                       + stats.model_seconds)
            parts["engine.step() wall (with output processing)"].append(whole)

    run(0)
    parts.clear()
    for seed in (1, 2, 3):
        run(seed)
    print(f"\n=== batch-1 decode step, {torch.get_num_threads()} threads, "
          f"{engine.model_config.num_hidden_layers} layers (ms, p50 over {len(parts['prepare'])} steps)")
    for name, times in parts.items():
        print(f"  {name}: {statistics.median(times) * 1e3:.3f}")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        run(4)
    steps = OUTPUT_LEN   # the prefill step is in the profile too: its ops have other shapes, listed apart
    averages = profiler.key_averages(group_by_input_shape=True)
    print(f"\n=== torch.profiler, one request (1 prefill + {steps - 1} decode steps): self CPU ms per decode step")
    rows = sorted(averages, key=lambda event: -event.self_cpu_time_total)
    for event in rows[:30]:
        print(f"  {event.key:<40} {str(event.input_shapes)[:70]:<70} calls {event.count:>6} "
              f"self {event.self_cpu_time_total / 1e3 / (steps - 1):8.3f}")

    model = engine.runner.model
    kinds = weight_bytes_per_token(model)
    total = sum(kinds.values())
    print("\n=== weights read per token")
    for kind, held in sorted(kinds.items(), key=lambda item: -item[1]):
        print(f"  {kind}: {held / 1e6:.1f} MB")
    print(f"  total {total / 1e6:.1f} MB")
    for threads in (1, 2):
        rate = read_rate(threads)
        print(f"  read rate, {threads} thread(s): {rate / 1e9:.1f} GB/s -> floor {total / rate * 1e3:.2f} ms a token")
    engine.shutdown()


if __name__ == "__main__":
    main()
