"""Benchmark requests: the shared JSON Lines format, or the same distribution generated here."""
from __future__ import annotations

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
