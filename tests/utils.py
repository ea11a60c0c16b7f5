"""Helpers shared by the tests of the streaming clients (AsyncLLM, the Ray data-parallel client) on the tiny
random models: prompts of random token ids, greedy settings, and a stream read to its end."""
from __future__ import annotations

import random

from pagedllm import SamplingParams


def random_prompts(count: int, seed: int = 0, min_len: int = 2, max_len: int = 40) -> list[dict]:
    """Token-id prompts for the tiny models' 256-token vocabulary, past the special ids 0-2."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(rng.randint(min_len, max_len))]}
            for _ in range(count)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


async def collect(llm, prompt, params: SamplingParams, request_id: str) -> list:
    """Every output the client streams for one request."""
    return [output async for output in llm.generate(prompt, params, request_id)]
