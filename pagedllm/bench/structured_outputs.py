"""`pagedllm bench structured`: what structured outputs cost a decode step.

--batch requests decode together on the model in three modes, in alternating rounds: plain (no
grammar), structured (every request under one JSON schema, so one compile) and mixed (half of each).
Only pure decode steps are timed (every request decoding one token), wall time around
LLMEngine.step(), so the figures hold everything a grammar adds: the bitmask filled in schedule(),
applied to the logits, and the matchers advanced in update_from_output(). Every request runs exactly
--steps + 8 tokens (the schema needs far more), so the modes time the same steps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from pagedllm.bench.decode_steps import cpu_name, decode_step_seconds
from pagedllm.bench.scheduling import percentile
from pagedllm.bench.workload import random_workload

# Long enough that no request can finish its object within the measured tokens.
SCHEMA = {"type": "object", "required": ["title", "words"],
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "words": {"type": "array", "minItems": 200, "maxItems": 400,
                                   "items": {"type": "string", "minLength": 3, "maxLength": 12}}}}
MODES = ("plain", "structured", "mixed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--dtype", default="auto")


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    load_before = os.getloadavg()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, kv_cache_memory="1GiB",
              max_model_len=args.prompt_len + args.steps + 64)
    engine = llm.llm_engine
    prompts = [item.prompt_token_ids for item in random_workload(num=args.batch, in_min=args.prompt_len,
                                                                   in_max=args.prompt_len,
                                                                   vocab=engine.model_config.vocab_size)]
    plain = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    structured = SamplingParams(temperature=0, max_tokens=args.steps + 8,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))
    params = {"plain": [plain] * args.batch, "structured": [structured] * args.batch,
              "mixed": [structured if index % 2 else plain for index in range(args.batch)]}
    started = time.perf_counter()
    engine.structured_output.request_grammar(structured.structured_outputs).compiled.result()
    compile_seconds = time.perf_counter() - started
    decode_step_seconds(engine, prompts, params["mixed"], "warm-up")   # discarded: first runs are slower
    times: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = MODES if round_index % 2 == 0 else MODES[::-1]
        for mode in order:
            times[mode] += decode_step_seconds(engine, prompts, params[mode], f"{mode}-{round_index}")
    load_after = os.getloadavg()
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after; batch {args.batch}, {len(times['plain'])} decode steps per mode, "
          f"{args.rounds} rounds; schema compile {compile_seconds * 1e3:.0f} ms (once, off the engine thread)")
    print("| batch of decode steps | median step | p90 | against plain | outside the model, median "
          "| CPU time per step, median | against plain |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(step for step, _, _ in times["plain"])
    cpu_base = statistics.median(cpu for _, _, cpu in times["plain"])
    labels = {"plain": f"{args.batch} plain", "structured": f"{args.batch} under a JSON schema",
              "mixed": f"{args.batch // 2} plain + {args.batch - args.batch // 2} under the schema"}
    for mode in MODES:
        steps = [step for step, _, _ in times[mode]]
        median = statistics.median(steps)
        outside = statistics.median(other for _, other, _ in times[mode])
        cpu = statistics.median(cpu for _, _, cpu in times[mode])
        print(f"| {labels[mode]} | {median * 1e3:.2f} ms | {percentile(steps, 0.9) * 1e3:.2f} ms "
              f"| {median / base - 1:+.1%} | {outside * 1e3:.2f} ms | {cpu * 1e3:.1f} ms | {cpu / cpu_base - 1:+.1%} |")
