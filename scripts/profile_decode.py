"""Where a batch-1 decode step's time goes (issue 26): the bundled GGUF with all defaults, 128 random prompt
tokens, 128 greedy output tokens, as `pagedllm bench latency --batch-size 1 --input-len 128 --output-len 128`.

Prints the step's parts as the engine times them (scheduling, the runner's preparation, the forward pass with
sampling) over three requests after a warm-up; torch.profiler's operators over the decode steps of one more
request, the quantized matmuls split by weight shape; the bytes of weights one token reads and this machine's
memory read rate with 1 and 2 threads (a sum over 1 GiB), which together give the bandwidth floor of a step;
and the rate the quantized matmuls alone reach streaming the model's own weights from memory, called in a
decode step's order on one row, against a plain 2-thread read of the same number of bytes.
A one-row step's 30 layers run in one parallel region (csrc/decode_layers.cpp), so the profiler shows them as one
`pagedllm::decode_one_row` (the shares inside are not recorded; thread 0's norms, silu and rope still are); set
PAGEDLLM_DECODE_STACK=0 for the per-kernel list of the Python layers.
Run it in a benchmark window: `python scripts/profile_decode.py` (`--stream-only`: that last part alone;
`--num-loras 1`: every request with a random rank-16 adapter over every linear layer, as `bench latency
--num-loras 1` serves it, to set its step beside the base's; `--steps-only`: without the bytes and read rates).
The one-row step's adapter plans, made before its region, show as `pagedllm::decode_lora_plans`.
"""
import argparse
import collections
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.lora_adapters import add_lora_arguments, lora_engine_settings, lora_requests_from_args
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


def step_order_layers(model: torch.nn.Module) -> list[QuantizedLinear]:
    """The quantized layers a batch-1 decode step runs, in its order (each layer's projections, the LM head)."""
    return [module for name, module in model.named_modules()
            if isinstance(module, QuantizedLinear) and not name.endswith(".table")]


def stream_rate(layers: list[QuantizedLinear], dtype: torch.dtype, passes: int = 20) -> tuple[float, int]:
    """(seconds, bytes) of the best pass of one row of dtype (the LM head's: its own) through every layer's
    kernel: the model's weights are far past the caches, so each pass streams them from memory as a step does."""
    calls = []
    for layer in layers:
        x = torch.randn(1, layer.in_features).to(layer.out_dtype or dtype)
        out = x.new_empty(1, layer.out_features)
        kernel = layer.matmul.kernel(x.dtype, 1)
        calls.append((kernel, out, x, layer))
    held = sum(t.nbytes for layer in layers for t in (layer.qweight, layer.scales, layer.mins) if t is not None)
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for kernel, out, x, layer in calls:
            kernel(out, x, layer.qweight, layer.scales, layer.mins, layer.bias, layer.bits, layer.group_size)
        best = min(best, time.perf_counter() - started)
    return best, held


def print_stream_rate(model: torch.nn.Module, dtype: torch.dtype) -> None:
    seconds, held = stream_rate(step_order_layers(model), dtype)
    print(f"\n=== quantized matmuls alone, one row, a decode step's order ({torch.get_num_threads()} threads)")
    print(f"  {held / 1e6:.1f} MB in {seconds * 1e3:.3f} ms: {held / seconds / 1e9:.1f} GB/s "
          f"(plain {torch.get_num_threads()}-thread read of as many bytes: "
          f"{read_rate(torch.get_num_threads(), gib=held / 2**30) / 1e9:.1f} GB/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream-only", action="store_true", help="only the matmuls' stream rate")
    parser.add_argument("--steps-only", action="store_true",
                        help="only the step's parts and the profile, not the weights' bytes and read rates "
                             "(to set trees or adapters side by side in a short window)")
    add_lora_arguments(parser)
    args = parser.parse_args()
    args.model = None   # the bundled model, whose shapes the random adapters take
    with lora_requests_from_args(args) as adapters:
        profile(args, adapters[0] if adapters else None)


def profile(args: argparse.Namespace, adapter) -> None:
    """The parts above, every request with `adapter` (None: the base alone)."""
    llm = LLM(enable_prefix_caching=False, max_num_seqs=1, **(lora_engine_settings([adapter]) if adapter else {}))
    engine = llm.llm_engine
    if args.stream_only:
        print_stream_rate(engine.runner.model, engine.dtype)
        engine.shutdown()
        return
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    parts = collections.defaultdict(list)

    def run(seed: int) -> None:
        item = random_workload(num=1, in_min=INPUT_LEN, in_max=INPUT_LEN, vocab=engine.model_config.vocab_size,
                               seed=seed)[0]
        engine.add_request(f"r{seed}", {"prompt_token_ids": item.prompt_token_ids}, params, lora_request=adapter)
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
          f"{engine.model_config.num_hidden_layers} layers, adapter {adapter.lora_name if adapter else 'none'} "
          f"(ms, p50 over {len(parts['prepare'])} steps)")
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
    if args.steps_only:
        engine.shutdown()
        return

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
    print_stream_rate(model, engine.dtype)
    engine.shutdown()


if __name__ == "__main__":
    main()
