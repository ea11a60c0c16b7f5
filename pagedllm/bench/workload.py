"""Benchmark requests: the shared JSON Lines format, or the same distribution generated here."""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def load_jsonl(path: str | Path) -> list[BenchRequest]:
    """One {"prompt_token_ids": [...], "max_tokens": N} per line (shared/bench/make_workload.py)."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        try:
            requests.append(BenchRequest(list(record["prompt_token_ids"]), int(record["max_tokens"])))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: expected prompt_token_ids and max_tokens ({exc})") from None
    return requests


def random_workload(num: int = 128, in_min: int = 32, in_max: int = 512, out_min: int = 32,
                    out_max: int = 256, vocab: int = 49152, first_id: int = 100, seed: int = 0) -> list[BenchRequest]:
    """The shared workload's generator: with its defaults this is the same 128 requests,
    37,223 prompt and 17,977 output tokens."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        n_in = rng.randint(in_min, in_max)
        n_out = rng.randint(out_min, out_max)
        requests.append(BenchRequest([rng.randrange(first_id, vocab) for _ in range(n_in)], n_out))
    return requests


def shared_prefix_workload(num: int = 64, prefix_len: int = 1024, suffix_len: int = 32, output_len: int = 64,
                           vocab: int = 49152, first_id: int = 100, seed: int = 0) -> list[BenchRequest]:
    """num requests that all start with the same prefix_len random tokens (a long system prompt), each
    followed by suffix_len random tokens of its own, and output_len tokens to generate."""
    rng = random.Random(seed)
    prefix = [rng.randrange(first_id, vocab) for _ in range(prefix_len)]
    return [BenchRequest(prefix + [rng.randrange(first_id, vocab) for _ in range(suffix_len)], output_len)
            for _ in range(num)]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="random",
                        help="a JSON Lines workload (shared/bench format), 'random', or 'shared-prefix' "
                             "(--num-prompts requests sharing --shared-prefix-len tokens)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=None,
                        help="random dataset: prompt length (default: the shared workload's 32-512 spread)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="random dataset: output length (default: the shared workload's 32-256 spread); "
                             "shared-prefix dataset: each request's output (default: 64)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="random dataset with --input-len/--output-len: lengths vary by +- this fraction")
    parser.add_argument("--shared-prefix-len", type=int, default=1024,
                        help="shared-prefix dataset: random tokens every prompt starts with")
    parser.add_argument("--suffix-len", type=int, default=32,
                        help="shared-prefix dataset: random tokens of each prompt's own after the prefix")
    parser.add_argument("--seed", type=int, default=0)


def workload_from_args(args: argparse.Namespace, vocab_size: int | None = None) -> list[BenchRequest]:
    if args.dataset == "shared-prefix":
        for name in ("num_prompts", "shared_prefix_len", "suffix_len"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        return shared_prefix_workload(num=args.num_prompts, prefix_len=args.shared_prefix_len,
                                      suffix_len=args.suffix_len, output_len=args.output_len or 64,
                                      vocab=vocab_size or 49152, seed=args.seed)
    if args.dataset != "random":
        return load_jsonl(args.dataset)
    if args.input_len is None and args.output_len is None:
        return random_workload(num=args.num_prompts, seed=args.seed)

    def spread(length: int) -> tuple[int, int]:
        return max(1, int(length * (1 - args.range_ratio))), max(1, int(length * (1 + args.range_ratio)))

    in_min, in_max = spread(args.input_len or 256)
    out_min, out_max = spread(args.output_len or 128)
    return random_workload(num=args.num_prompts, in_min=in_min, in_max=in_max, out_min=out_min,
                           out_max=out_max, vocab=vocab_size or 49152, seed=args.seed)
