"""`pagedllm bench logit-controls`: what logit_bias / allowed_token_ids / bad_words and prompt_logprobs cost.

The logit controls change only the sampling step, so that step is timed alone: a decode batch's
SamplingBatch.build + sample on random logits of the bundled model's vocabulary, with no row using
the controls, one row using all three, and every row using them. The issue's figure is the whole decode
step, so that is timed too: the same batch of requests decoding on the model, greedy and sampled, plain and
every row with the controls, back to back in each round (wall time of the steps in which every request
decodes), reported as the median of the rounds' ratios.
Prompt logprobs add logits rows to the forward pass, so they are timed end to end: the same prompts
prefilled (one token generated) with and without prompt_logprobs. Variants alternate so slow drift of the
machine falls on all alike; each figure is a median, in CPU seconds of this process (a shared machine
disturbs them less than wall time) except the decode steps' wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.decode_steps import cpu_name, decode_step_seconds
from pagedllm.bench.workload import random_workload
from pagedllm.worker.input_batch import SamplingColumns
from pagedllm.worker.sampler import SamplingBatch, sample

VOCAB_SIZE = 49152   # the bundled SmolLM2's
CONTROLS = dict(logit_bias={11: 2.0, 260: -1.0}, allowed_token_ids=list(range(200, 4200)),
                bad_words_token_ids=[[300, 301], [302]])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--sampler-rounds", type=int, default=200, help="sampling steps per variant (default: 200)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default: 64)")
    parser.add_argument("--rounds", type=int, default=3, help="prefill rounds per variant (default: 3)")
    parser.add_argument("--decode-steps", type=int, default=20, help="decode steps timed per variant and round")
    parser.add_argument("--decode-rounds", type=int, default=6,
                        help="plain/controlled pairs per kind, alternating order (default: 6)")
    parser.add_argument("--parts", default="sampler,decode,prefill",
                        help="comma-separated: sampler, decode, prefill (default: all three)")
    parser.add_argument("--dtype", default="auto")


def _sampling_step_seconds(params: list[SamplingParams], rounds: int) -> list[float]:
    """CPU seconds of build + sample for one decode step of these rows, `rounds` times."""
    columns = SamplingColumns(len(params))
    for row, row_params in enumerate(params):
        columns.set_row(row, row_params, (2,), None)
    rows = np.arange(len(params))
    token_ids = np.random.default_rng(0).integers(0, VOCAB_SIZE, (len(params), 64)).astype(np.int32)
    num_prompt, num_tokens = np.full(len(params), 32), np.full(len(params), 48)
    logits = torch.randn(len(params), VOCAB_SIZE)
    seconds = []
    for _ in range(rounds):
        started = time.process_time()
        sample(logits, SamplingBatch.build(columns, rows, token_ids, num_prompt, num_tokens, VOCAB_SIZE, "cpu"))
        seconds.append(time.process_time() - started)
    return seconds


def _prefill_seconds(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    started = time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.process_time() - started


def _report(title: str, medians: dict[str, float], unit: str, scale: float) -> None:
    print(title)
    baseline = next(iter(medians.values()))
    for name, median in medians.items():
        print(f"  {name:36s} {median * scale:9.3f} {unit}   {100 * (median / baseline - 1):+7.1f}%")


def _decode_steps(args: argparse.Namespace) -> None:
    """Whole decode steps on the model, greedy and sampled (temperature 0.8, top-p 0.9), each plain against
    every row with the controls (the pairs are reported apart: a sampled step costs more than a greedy one).

    Each round runs the plain batch and the controlled one back to back (ABAB, then BABA), and the figure
    is the median over rounds of each round's ratio of medians: slow drift of a shared machine falls on
    both halves of a round alike and cancels in its ratio, where medians over all steps would keep it."""
    llm = LLM(dtype=args.dtype, max_num_seqs=args.batch_size, kv_cache_memory="1GiB",
              max_model_len=32 + args.decode_steps + 16)
    engine = llm.llm_engine
    prompts = [item.prompt_token_ids for item in random_workload(num=args.batch_size, in_min=32, in_max=32,
                                                                   vocab=engine.model_config.vocab_size)]
    length = dict(max_tokens=args.decode_steps + 8, ignore_eos=True)
    pairs = {kind: {"no row with controls": SamplingParams(**sampling, **length),
                    "every row with controls": SamplingParams(**sampling, **length, **CONTROLS)}
             for kind, sampling in (("greedy", dict(temperature=0)), ("sampled", dict(temperature=0.8, top_p=0.9)))}
    decode_step_seconds(engine, prompts, [pairs["greedy"]["every row with controls"]] * args.batch_size, "warm-up")
    seconds = {(kind, name): [] for kind, variants in pairs.items() for name in variants}
    ratios: dict[str, list[float]] = {kind: [] for kind in pairs}
    for round_index in range(args.decode_rounds):
        for kind, variants in pairs.items():
            order = list(variants) if round_index % 2 == 0 else list(variants)[::-1]
            medians = {}
            for name in order:
                steps = decode_step_seconds(engine, prompts, [variants[name]] * args.batch_size,
                                            f"{kind}-{name}-{round_index}")
                seconds[(kind, name)] += [wall for wall, _, _ in steps]
                medians[name] = statistics.median(wall for wall, _, _ in steps)
            ratios[kind].append(medians["every row with controls"] / medians["no row with controls"])
    for kind, variants in pairs.items():
        _report(f"decode step on the model, {kind}, batch {args.batch_size}, {cpu_name()}, wall time "
                f"(median of {len(seconds[(kind, 'no row with controls')])}):",
                {name: statistics.median(seconds[(kind, name)]) for name in variants}, "ms", 1e3)
        print(f"  controls against plain, median of {len(ratios[kind])} rounds' ratios: "
              f"{100 * (statistics.median(ratios[kind]) - 1):+.1f}% "
              f"(rounds: {', '.join(f'{100 * (ratio - 1):+.1f}%' for ratio in ratios[kind])})")


def run(args: argparse.Namespace) -> None:
    plain = SamplingParams(temperature=0.8, top_p=0.9)
    controlled = SamplingParams(temperature=0.8, top_p=0.9, **CONTROLS)
    parts = set(args.parts.split(","))
    if parts - {"sampler", "decode", "prefill"}:
        raise ValueError(f"--parts: unknown part(s) {sorted(parts - {'sampler', 'decode', 'prefill'})}")
    if "decode" in parts:
        _decode_steps(args)
    if "sampler" in parts:
        _sampler_steps(args, plain, controlled)
    if "prefill" in parts:
        _prefill_steps(args)


def _sampler_steps(args: argparse.Namespace, plain: SamplingParams, controlled: SamplingParams) -> None:
    samplers = {"no row with controls": [plain] * args.batch_size,
                "1 row with controls": [controlled] + [plain] * (args.batch_size - 1),
                "every row with controls": [controlled] * args.batch_size}
    _sampling_step_seconds(samplers["no row with controls"], 10)   # warm-up
    seconds = {name: [] for name in samplers}
    for _ in range(10):   # interleaved slices
        for name, params in samplers.items():
            seconds[name] += _sampling_step_seconds(params, max(1, args.sampler_rounds // 10))
    _report(f"sampling step, batch {args.batch_size}, vocabulary {VOCAB_SIZE} (median of {args.sampler_rounds}):",
            {name: statistics.median(values) for name, values in seconds.items()}, "ms", 1e3)


def _prefill_steps(args: argparse.Namespace) -> None:
    llm = LLM(dtype=args.dtype, max_num_seqs=args.batch_size, enable_prefix_caching=False,
              max_model_len=args.prompt_len + 8)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 4000 + 200 for j in range(args.prompt_len)]}
               for i in range(args.batch_size)]
    prefills = {"no prompt_logprobs": SamplingParams(temperature=0, max_tokens=1),
                "prompt_logprobs=5 on every row": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)}
    _prefill_seconds(llm, prompts, prefills["no prompt_logprobs"])   # warm-up
    seconds = {name: [] for name in prefills}
    for _ in range(args.rounds):
        for name, params in prefills.items():
            seconds[name].append(_prefill_seconds(llm, prompts, params))
    _report(f"prefill of {args.batch_size} prompts of {args.prompt_len} tokens (median of {args.rounds}):",
            {name: statistics.median(values) for name, values in seconds.items()}, "s", 1.0)
