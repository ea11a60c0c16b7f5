"""`pagedllm bench latency`: batches of fixed input/output length, timed over several iterations.

Reports the prefill time of the batch, the per-step decode time (p50/p99 over every decode step of every
measured iteration) and decode tokens/s (tokens over the decode time), for each batch size, quantization,
activation dtype and speculative config asked for, side by side in one run. The random workload has nothing to copy; the
copy workload (`--dataset copy`) asks the model to quote code back, edit or summarise a text, where
speculation pays. With speculation, the mean acceptance length (tokens per verification) is reported too.
With `--lora` or `--num-loras`, every configuration is measured also with an adapter (the first), on an
engine with LoRA on, beside the base on one without. `--alternate-rounds N` holds every configuration's
engine at once and measures them in turn, N rounds over (the order reversed every other round), printing each
round's decode step p50 and decode tok/s of each and its decode time a token over the first configuration's
(the first's tok/s over its), its prefill p50 and that over the first's, then the medians of those ratios: on a
shared machine, whose speed drifts between runs by more than a feature costs, drift moves every part of a round
alike and cancels in its ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics

from pagedllm.bench.copy_workload import copy_heavy_workload
from pagedllm.bench.lora_adapters import add_lora_arguments, lora_engine_settings, lora_requests_from_args
from pagedllm.bench.scheduling import percentile
from pagedllm.bench.workload import random_workload

DATASETS = ("random", "copy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--batch-size", default="8", help="comma-separated for a sweep, e.g. 1,4,16,64")
    parser.add_argument("--input-len", type=int, default=128, help="random dataset: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature (default: 0, greedy); above 0 the steps sample")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default: 1.0, off)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto",
                        help="comma-separated values (e.g. none,auto): measured side by side in this run")
    parser.add_argument("--activation-dtype", default="auto",
                        help="comma-separated activation_dtype values (auto, model, int16, int8; e.g. model,auto): "
                             "measured side by side in this run")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--speculative-config", action="append", default=None, metavar="JSON",
                        help="a speculative_config as JSON, or 'none'; repeat the flag to measure several side by "
                             "side (default: none)")
    parser.add_argument("--dataset", default="random",
                        help=f"comma-separated among {', '.join(DATASETS)}: random token prompts of --input-len, "
                             "or copy-heavy chat prompts (quote code, edit, summarise)")
    add_lora_arguments(parser)
    parser.add_argument("--alternate-rounds", type=int, default=0,
                        help="measure the configurations (quantizations x speculative configs x base/adapter) in "
                             "turn (ABAB..) this many rounds, each round's decode step p50s, tok/s and time a token "
                             "against the first configuration, its prefill p50 against the first's, and the median "
                             "ratios (default: 0, off)")


def _speculative_configs(values: list[str] | None) -> list[dict | None]:
    configs = []
    for value in values or ["none"]:
        config = None if value == "none" else json.loads(value)
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"--speculative-config must be a JSON object or 'none', got {value!r}")
        configs.append(config)
    return configs


def run(args: argparse.Namespace) -> None:
    batch_sizes = [int(size) for size in args.batch_size.split(",")]
    datasets = args.dataset.split(",")
    if not set(datasets) <= set(DATASETS):
        raise ValueError(f"--dataset must be among {', '.join(DATASETS)}, got {args.dataset!r}")
    print(f"input {args.input_len} (random), output {args.output_len}, KV cache {args.kv_cache_dtype}, "
          f"tensor parallel {args.tensor_parallel_size}, {args.num_iters} iterations, "
          f"temperature {args.temperature}, top-p {args.top_p}")
    if args.alternate_rounds < 0:
        raise ValueError(f"--alternate-rounds must be >= 0, got {args.alternate_rounds}")
    with lora_requests_from_args(args) as adapters:
        configurations = [(quantization, activation_dtype, speculative_config, adapter)
                          for quantization in args.quantization.split(",")
                          for activation_dtype in args.activation_dtype.split(",")
                          for speculative_config in _speculative_configs(args.speculative_config)
                          for adapter in [None, *adapters[:1]]]
        if args.alternate_rounds:
            if len(configurations) < 2:
                raise ValueError("--alternate-rounds alternates configurations: give two or more (--quantization a,b, "
                                 "--activation-dtype a,b, --speculative-config twice, or --lora / --num-loras)")
            _alternate(args, batch_sizes, datasets, configurations)
            return
        print("| quantization | dtype | speculative | dataset | batch | prefill ms p50 | p99 | decode step ms p50 "
              "| p99 | decode tok/s | mean acceptance length | LoRA |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for configuration in configurations:
            _measure_configuration(args, batch_sizes, datasets, *configuration)


def _engine(args: argparse.Namespace, batch_sizes: list[int], quantization: str, activation_dtype: str,
            speculative_config: dict | None, adapter):
    """The engine a configuration runs on: LoRA on with the adapter's settings, or off (adapter None)."""
    from pagedllm import LLM

    return LLM(args.model, dtype=args.dtype, quantization=quantization, activation_dtype=activation_dtype,
               kv_cache_dtype=args.kv_cache_dtype,
               block_size=args.block_size, tensor_parallel_size=args.tensor_parallel_size,
               enable_prefix_caching=False, max_num_seqs=max(batch_sizes),
               max_num_batched_tokens=max(2048, max(batch_sizes) * args.input_len),
               speculative_config=speculative_config, **(lora_engine_settings([adapter]) if adapter else {}))


def _speculative_label(speculative_config: dict | None) -> str:
    return "none" if speculative_config is None else json.dumps(speculative_config)


def _quantization_label(quantization: str, activation_dtype: str) -> str:
    return quantization if activation_dtype == "auto" else f"{quantization}, activation_dtype={activation_dtype}"


def _label(quantization: str, activation_dtype: str, speculative_config: dict | None, adapter) -> str:
    return (f"{_quantization_label(quantization, activation_dtype)}, speculative "
            f"{_speculative_label(speculative_config)}, LoRA {adapter.lora_name if adapter else 'none'}")


def _alternate(args: argparse.Namespace, batch_sizes: list[int], datasets: list[str], configurations: list) -> None:
    """Every configuration's engine held at once and measured in turn, round by round; ratios against the first."""
    engines = [_engine(args, batch_sizes, *configuration) for configuration in configurations]
    labels = [_label(*configuration) for configuration in configurations]
    print(f"{len(configurations)} configurations in turn, {args.alternate_rounds} rounds; the first: {labels[0]}")
    print("| dataset | batch | round | configuration | decode step ms p50 | decode tok/s "
          "| time a token against the first | prefill ms p50 | prefill time against the first |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dataset in datasets:
        for batch_size in batch_sizes:
            ratios = [[] for _ in configurations]
            prefill_ratios = [[] for _ in configurations]
            for round_index in range(1, args.alternate_rounds + 1):
                order = list(range(len(engines)))
                if round_index % 2 == 0:   # ABBA: a steady drift of the machine lands on both sides
                    order.reverse()
                results = [None] * len(engines)
                for index in order:
                    prefills, decodes, tokens_per_second, _ = measure(engines[index], args, batch_size, dataset,
                                                                      configurations[index][-1])
                    results[index] = (statistics.median(decodes), tokens_per_second, statistics.median(prefills))
                for index, (label, (step, tokens_per_second, prefill)) in enumerate(zip(labels, results)):
                    ratios[index].append(results[0][1] / tokens_per_second)
                    prefill_ratios[index].append(prefill / results[0][2])
                    print(f"| {dataset} | {batch_size} | {round_index} | {label} | {step * 1e3:.2f} "
                          f"| {tokens_per_second:.1f} | {ratios[index][-1]:.3f} | {prefill * 1e3:.1f} "
                          f"| {prefill_ratios[index][-1]:.3f} |")
            for label, config_ratios, config_prefill_ratios in list(zip(labels, ratios, prefill_ratios))[1:]:
                print(f"dataset {dataset}, batch {batch_size}, {label}: median ratio "
                      f"{_spread(config_ratios)}; prefill median ratio {_spread(config_prefill_ratios)}")
    for llm in engines:
        llm.llm_engine.shutdown()


def _spread(ratios: list[float]) -> str:
    return (f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
            f"over {len(ratios)} rounds")


def _measure_configuration(args: argparse.Namespace, batch_sizes: list[int], datasets: list[str], quantization: str,
                           activation_dtype: str, speculative_config: dict | None, adapter) -> None:
    """One engine's rows: every dataset and batch size; with an adapter, every request runs with it."""
    llm = _engine(args, batch_sizes, quantization, activation_dtype, speculative_config, adapter)
    weights = _quantization_label(quantization, activation_dtype)
    speculative = _speculative_label(speculative_config)
    lora_label = adapter.lora_name if adapter else "none"
    for dataset in datasets:
        for batch_size in batch_sizes:
            prefills, decodes, tokens_per_second, acceptance = measure(llm, args, batch_size, dataset, adapter)
            print(f"| {weights} | {str(llm.llm_engine.dtype).removeprefix('torch.')} | {speculative} "
                  f"| {dataset} | {batch_size} | {statistics.median(prefills) * 1e3:.1f} "
                  f"| {percentile(prefills, 0.99) * 1e3:.1f} | {statistics.median(decodes) * 1e3:.1f} "
                  f"| {percentile(decodes, 0.99) * 1e3:.1f} | {tokens_per_second:.1f} "
                  f"| {'-' if acceptance is None else f'{acceptance:.2f}'} | {lora_label} |")
    llm.llm_engine.shutdown()


def measure(llm, args: argparse.Namespace, batch_size: int, dataset: str = "random", lora_request=None
            ) -> tuple[list[float], list[float], float, float | None]:
    """Prefill times of the batch, every decode step's time over the measured iterations, decode tokens/s
    (every token after each request's first over the iteration's decode time; the median iteration, so a
    stall on a shared machine moves it less), and the mean acceptance length of the measured iterations
    (None without speculation)."""
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.output_len,
                            ignore_eos=True)
    prefills, decodes, rates = [], [], []
    spec_before = None
    for iteration in range(args.num_iters_warmup + args.num_iters):
        if dataset == "copy":
            workload = copy_heavy_workload(engine.tokenizer, batch_size, args.output_len,
                                           seed=iteration * 1000 + batch_size)
        else:
            workload = random_workload(num=batch_size, in_min=args.input_len, in_max=args.input_len,
                                       vocab=engine.model_config.vocab_size, seed=iteration)
        for index, item in enumerate(workload):
            engine.add_request(f"{dataset}-{batch_size}-{iteration}-{index}",
                               {"prompt_token_ids": item.prompt_token_ids}, params, lora_request=lora_request)
        if iteration == args.num_iters_warmup:
            spec_before = engine.stats().spec_decoding
        step_times = []
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.last_step_stats
            step_times.append(stats.scheduling_seconds + stats.prepare_seconds + stats.model_seconds)
        if iteration >= args.num_iters_warmup:
            prefills.append(step_times[0])
            decodes.extend(step_times[1:])
            rates.append(batch_size * (args.output_len - 1) / sum(step_times[1:]))
    tokens_per_second = statistics.median(rates)
    spec_after = engine.stats().spec_decoding
    acceptance = None
    if spec_after is not None:
        drafts = spec_after.num_drafts - spec_before.num_drafts
        accepted = spec_after.num_accepted_tokens - spec_before.num_accepted_tokens
        acceptance = 1 + accepted / drafts if drafts else 1.0
    return prefills, decodes, tokens_per_second, acceptance
