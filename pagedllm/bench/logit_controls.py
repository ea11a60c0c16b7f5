"""`pagedllm bench logit-controls`: what logit_bias / allowed_token_ids / bad_words and prompt_logprobs cost.

One engine runs the same greedy batch (every prompt decoding --output-len tokens, EOS ignored) with
no row using the controls, with one row using all three, and with every row using them; then the
same prompts prefilled with and without prompt_logprobs. The variants alternate over --rounds so
slow drift of the machine falls on all alike; each figure is the median round's CPU time of this
process (all its threads), which other processes on a shared machine disturb far less than wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams

CONTROLS = dict(logit_bias={11: 2.0, 260: -1.0}, allowed_token_ids=list(range(200, 4200)),
                bad_words=["lighthouse keeper", " stairs"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default: 64)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens each request decodes (default: 32)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant, alternating (default: 3)")
    parser.add_argument("--dtype", default="auto")


def _timed(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> float:
    started = time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.process_time() - started


def run(args: argparse.Namespace) -> None:
    llm = LLM(dtype=args.dtype, max_num_seqs=args.batch_size, enable_prefix_caching=False,
              max_model_len=args.prompt_len + args.output_len + 8)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 4000 + 200 for j in range(args.prompt_len)]}
               for i in range(args.batch_size)]
    plain = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    controlled = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, **CONTROLS)
    prefill_only = SamplingParams(temperature=0, max_tokens=1)
    variants = {
        "decode, no row with controls": [plain] * args.batch_size,
        "decode, 1 row with controls": [controlled] + [plain] * (args.batch_size - 1),
        "decode, every row with controls": [controlled] * args.batch_size,
        "prefill, no prompt_logprobs": [prefill_only] * args.batch_size,
        "prefill, prompt_logprobs=5 on every row": [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)]
        * args.batch_size,
    }
    _timed(llm, prompts, variants["decode, no row with controls"])   # warm-up, discarded
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, params in variants.items():
            seconds[name].append(_timed(llm, prompts, params))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"batch {args.batch_size}, prompts of {args.prompt_len} tokens, {args.output_len} decoded tokens each, "
          f"median CPU seconds of {args.rounds} rounds")
    baselines = {"decode": medians["decode, no row with controls"], "prefill": medians["prefill, no prompt_logprobs"]}
    for name, median in medians.items():
        baseline = baselines[name.split(",")[0]]
        print(f"{name:42s} {median:8.3f} s   {100 * (median / baseline - 1):+6.1f}%")
