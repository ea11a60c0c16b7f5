"""`pagedllm bench throughput`: offline throughput on a fixed workload, ours against transformers.

Every request runs to exactly its max_tokens (ignore_eos), so both backends do the
same work. `--backend hf` runs transformers' `generate` with static batches (left
padding; only each request's own tokens are counted), in the same process, which is
the brief's baseline; `--backend both` measures the two side by side in one run.
`--cascade-attention off,auto` runs pagedllm with shared-prefix attention off and at its default (auto: the
groups its start-up timing says pay; on: every group), side by side, and `--profile-attention` times the attention layers of each run with torch.profiler.
`--lora` (adapter folders) or `--num-loras N --lora-rank R` (random adapters over every linear layer)
runs pagedllm with the adapters, each request given a random one (seeded), beside the base alone.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import time

from pagedllm.bench import kv_trace
from pagedllm.bench.compute_floor import measure_matmul_rate, workload_flops
from pagedllm.bench.kv_trace import KVTrace
from pagedllm.bench.lora_adapters import add_lora_arguments, lora_engine_settings, lora_requests_from_args
from pagedllm.bench.workload import BenchRequest, add_workload_arguments, workload_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--backend", choices=("pagedllm", "hf", "both"), default="pagedllm")
    add_workload_arguments(parser)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto",
                        help="comma-separated values (e.g. none,auto): pagedllm runs once per value, side by side")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="comma-separated values (e.g. auto,bfloat16): pagedllm runs once per value, side by side")
    parser.add_argument("--activation-dtype", default="auto",
                        help="comma-separated activation_dtype values (auto, model, int16, int8; e.g. auto,int8): "
                             "pagedllm runs once per value, side by side")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--cascade-attention", default="auto",
                        help="comma-separated auto/on/off values (e.g. off,auto): pagedllm runs once per value with "
                             "enable_cascade_attention set so, side by side")
    parser.add_argument("--profile-attention", action="store_true",
                        help="run pagedllm under torch.profiler and report the time its decode and prefill "
                             "attention took (the profiler costs the run a little speed, alike on every run)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pagedllm generates the whole workload this many times per configuration and reports the "
                             "last (the peers' protocol, ../shared/bench/peers: 2, with --no-prefix-caching)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="enable_prefix_caching for pagedllm (off: a repeat cannot reuse the previous run's KV)")
    add_lora_arguments(parser)
    parser.add_argument("--hf-max-batch-size", type=int, default=16)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="record the block map after every step (this costs the run some speed) and write it "
                             "as FILE.json and a PNG strip FILE.png")


CASCADE_VALUES = {"auto": None, "on": True, "off": False}


def _cascade_values(text: str) -> list[str]:
    values = text.split(",")
    if not values or any(value not in CASCADE_VALUES for value in values):
        raise ValueError(f"--cascade-attention takes comma-separated auto/on/off values, got {text!r}")
    return values


def _attention_profiler():
    import torch
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def _attention_times(profile, num_layers: int) -> dict:
    """Seconds in the attention ranges the model labels, and decode attention per step (a step with
    decodes runs the decode range once per layer)."""
    from pagedllm.model.attention import DECODE_RANGE, PREFILL_RANGE

    totals = {event.key: (event.cpu_time_total / 1e6, event.count) for event in profile.key_averages()
              if event.key in (DECODE_RANGE, PREFILL_RANGE)}
    decode_s, decode_calls = totals.get(DECODE_RANGE, (0.0, 0))
    decode_steps = decode_calls // num_layers
    return {"decode_attention_s": round(decode_s, 3), "decode_steps": decode_steps,
            "decode_attention_ms_per_step": round(1e3 * decode_s / max(decode_steps, 1), 3),
            "prefill_attention_s": round(totals.get(PREFILL_RANGE, (0.0, 0))[0], 3)}


def run_pagedllm(args: argparse.Namespace, workload: list[BenchRequest], quantization: str, kv_cache_dtype: str,
                 activation_dtype: str, cascade: str, adapters: list) -> dict:
    """One configuration's run; with adapters, each request runs with one of them, drawn with --seed."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
              activation_dtype=activation_dtype, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory, enable_cascade_attention=CASCADE_VALUES[cascade],
              enable_prefix_caching=args.prefix_caching, **(lora_engine_settings(adapters) if adapters else {}))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
    for adapter in adapters:   # loaded before the clock starts
        llm.add_lora(adapter)
    rng = random.Random(args.seed)
    lora_requests = [rng.choice(adapters) for _ in workload] if adapters else None
    trace = None
    if args.trace:
        trace = KVTrace(llm.llm_engine.kv_manager)
        llm.llm_engine.step_listeners.append(trace)
    for _ in range(args.repeats - 1):   # untimed runs first: warm caches, touched KV pages, oneDNN's kernels
        llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    profiler = _attention_profiler() if args.profile_attention else contextlib.nullcontext()
    started = time.perf_counter()
    with profiler as profile:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    elapsed = time.perf_counter() - started
    engine = llm.llm_engine
    attention_times = _attention_times(profile, engine.model_config.num_hidden_layers) if profile else {}
    if trace is not None:
        llm.llm_engine.step_listeners.remove(trace)
        name = f"{len(workload)} requests, quantization={quantization}"
        for written in kv_trace.save(args.trace, {name: trace}, llm.llm_engine.kv_manager.block_size):
            print(f"wrote {written}")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.stats()
    rate = measure_matmul_rate(engine.model_config, engine.dtype)
    floor = workload_flops(engine.model_config, workload, sum(o.num_cached_tokens for o in outputs)) / rate
    loras = f", {len(adapters)} LoRAs" if adapters else ""
    kv = f", kv_cache_dtype={kv_cache_dtype}" if kv_cache_dtype != "auto" else ""
    activations = f", activation_dtype={activation_dtype}" if activation_dtype != "auto" else ""
    return _figures(f"pagedllm (quantization={quantization}{kv}{activations}, cascade={cascade}{loras})", workload,
                    generated, elapsed, dtype=str(engine.dtype).removeprefix("torch."),
                    kv_cache_dtype=str(engine.kv_cache_dtype).removeprefix("torch."), activation_dtype=activation_dtype,
                    weights_mib=round(engine.model_info().weight_bytes / 2**20, 1),
                    preemptions=stats.num_preemptions, matmul_gflops=round(rate / 1e9, 1),
                    compute_floor_s=round(floor, 2), floor_fraction=round(floor / elapsed, 3),
                    cascade_attention=cascade, cascade_rule=engine.model_info().cascade_attention.describe(),
                    **attention_times)


def run_hf(args: argparse.Namespace, workload: list[BenchRequest]) -> dict:
    """transformers' generate in static batches of requests taken in order, left-padded."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.config.resolve import resolve_dtype
    from pagedllm.model.loader import load_checkpoint, resolve_model

    path = resolve_model(args.model)
    checkpoint_dtype = load_checkpoint(args.model).config.torch_dtype if args.dtype == "auto" else None
    dtype = resolve_dtype(args.dtype, checkpoint_dtype, torch.device("cpu"))
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                     trust_remote_code=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    model.eval()
    model.generation_config.eos_token_id = None
    pad = 0
    generated = 0
    started = time.perf_counter()
    size = args.hf_max_batch_size
    for first in range(0, len(workload), size):
        batch = workload[first:first + size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                             for r in batch])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in batch),
                           do_sample=False, pad_token_id=pad)
        generated += sum(r.max_tokens for r in batch)   # the useful tokens; the rest is padding work
    elapsed = time.perf_counter() - started
    return _figures(f"transformers (batch {size})", workload, generated, elapsed, dtype=str(dtype).removeprefix("torch."))


def _figures(backend: str, workload: list[BenchRequest], generated: int, elapsed: float, **extra) -> dict:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    return {"backend": backend, "requests": len(workload), "prompt_tokens": prompt_tokens,
            "output_tokens": generated, "elapsed_s": round(elapsed, 2),
            "requests_per_s": round(len(workload) / elapsed, 3),
            "output_tokens_per_s": round(generated / elapsed, 1),
            "total_tokens_per_s": round((prompt_tokens + generated) / elapsed, 1), **extra}


def run(args: argparse.Namespace) -> None:
    workload = workload_from_args(args)
    cascades = _cascade_values(args.cascade_attention)
    results = []
    if args.backend in ("pagedllm", "both"):
        with lora_requests_from_args(args) as adapters:
            results.extend(run_pagedllm(args, workload, quantization, kv_cache_dtype, activation_dtype, cascade,
                                        lora_set)
                           for quantization in args.quantization.split(",")
                           for kv_cache_dtype in args.kv_cache_dtype.split(",")
                           for activation_dtype in args.activation_dtype.split(",") for cascade in cascades
                           for lora_set in ([[], adapters] if adapters else [[]]))
    if args.backend in ("hf", "both"):
        results.append(run_hf(args, workload))
    print(f"{len(workload)} requests, {results[0]['prompt_tokens']} prompt + "
          f"{sum(r.max_tokens for r in workload)} output tokens")
    print("| backend | dtype | wall s | req/s | output tok/s | total tok/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['backend']} | {r['dtype']} | {r['elapsed_s']} | {r['requests_per_s']} "
              f"| {r['output_tokens_per_s']} | {r['total_tokens_per_s']} |")
    ours = results[0]
    if "compute_floor_s" in ours:
        print(f"compute floor: the workload's model matmuls at {ours['matmul_gflops']} GFLOP/s "
              f"({ours['dtype']}, measured in this run) take {ours['compute_floor_s']} s; "
              f"pagedllm's wall time is {ours['floor_fraction']:.0%} efficient against it")
    for r in results:
        if "cascade_rule" in r:
            print(f"{r['backend']}: cascade attention {r['cascade_rule']}")
        if "decode_attention_s" in r:
            print(f"{r['backend']}: decode attention {r['decode_attention_ms_per_step']} ms per step over "
                  f"{r['decode_steps']} steps ({r['decode_attention_s']} s), prefill attention "
                  f"{r['prefill_attention_s']} s (torch.profiler)")
    for other in results[1:]:
        print(f"{other['backend']} against {ours['backend']}, output tok/s: "
              f"{other['output_tokens_per_s'] / ours['output_tokens_per_s']:.2f}x")
        if "decode_attention_s" in other and other["decode_attention_ms_per_step"]:
            print(f"  decode attention per step: {ours['decode_attention_ms_per_step']} -> "
                  f"{other['decode_attention_ms_per_step']} ms, "
                  f"a {ours['decode_attention_ms_per_step'] / other['decode_attention_ms_per_step']:.2f}x speed-up")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
