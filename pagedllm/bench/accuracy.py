"""`pagedllm bench accuracy`: how often bfloat16 picks the same greedy tokens as float32.

Both runs take the same prompts (from the workload) and decode greedily. Reported:
the share of sequences identical to the end, the mean length of the common prefix,
and the share of positions holding the same token.
"""
from __future__ import annotations

import argparse
import statistics

from pagedllm.bench.workload import random_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--num-prompts", type=int, default=32, help="workload prompts, with --no-chat")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="natural chat prompts (default) instead of the workload's random token ids")


PROMPTS = ["Explain why the sky is blue.", "Write a haiku about the sea.", "What is 17 times 23?",
           "List three uses of Python.", "Summarise the plot of Hamlet in two sentences.",
           "How do vaccines work?", "Translate 'good morning' into French and German.",
           "Give me a recipe for pancakes."]


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(args.model, dtype=dtype, kv_cache_memory="1GiB")
        if args.chat:
            conversations = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            workload = random_workload(num=args.num_prompts, vocab=llm.llm_engine.model_config.vocab_size)
            outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload], params,
                                   use_tqdm=False)
        runs[dtype] = [o.outputs[0].token_ids for o in outputs]
        del llm
    prefixes, same_positions = [], 0
    for exact, approx in zip(runs["float32"], runs["bfloat16"]):
        common = next((i for i, (a, b) in enumerate(zip(exact, approx)) if a != b), len(exact))
        prefixes.append(common)
        same_positions += sum(a == b for a, b in zip(exact, approx))
    total = sum(len(tokens) for tokens in runs["float32"])
    print(f"{len(prefixes)} prompts, {args.max_tokens} greedy tokens each, bfloat16 against float32")
    print("| identical sequences | mean common prefix | same token at a position |")
    print("|---|---|---|")
    print(f"| {sum(p == args.max_tokens for p in prefixes) / len(prefixes):.0%} "
          f"| {statistics.fmean(prefixes):.1f} of {args.max_tokens} | {same_positions / total:.1%} |")
