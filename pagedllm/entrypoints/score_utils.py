"""Scoring text pairs, shared by LLM.score and the server's /v1/score and /v1/rerank: a cross-encoder reads
each (query, document) pair as one prompt; an embedding model embeds each text once and a pair scores the
cosine of its two embeddings."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.model.pooling_checkpoint import PoolingModelInfo
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.tokenizer import Tokenizer


def pair_up(first: str | Sequence[str], second: str | Sequence[str],
            names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[str, str]]:
    """vLLM's rule: one text against each of the others (1 -> N), or N texts pairwise (N -> N)."""
    sides = [[side] if isinstance(side, str) else list(side) for side in (first, second)]
    for name, texts in zip(names, sides):
        if not texts or not all(isinstance(text, str) and text for text in texts):
            raise ValueError(f"{name} must be a non-empty string or a non-empty list of non-empty strings")
    if len(sides[0]) == 1:
        return [(sides[0][0], text) for text in sides[1]]
    if len(sides[0]) != len(sides[1]):
        raise ValueError(f"{names[1]} must have as many texts as {names[0]} ({len(sides[0])}) when {names[0]} has "
                         f"more than one, got {len(sides[1])}")
    return list(zip(*sides))


def cross_encoder_prompt(tokenizer: Tokenizer, info: PoolingModelInfo, query: str, document: str) -> dict:
    """The pair as the tokenizer encodes a text pair (special tokens and separators as the model was trained
    with: what sentence-transformers' CrossEncoder feeds it), with its token types where the encoder has them."""
    encoded = tokenizer.hf(query, document)
    prompt = {"prompt_token_ids": list(encoded["input_ids"])}
    if info.encoder is not None and info.encoder.type_vocab_size > 1 and "token_type_ids" in encoded:
        prompt["token_type_ids"] = list(encoded["token_type_ids"])
    return prompt


@dataclass
class PairScore:
    request_id: str
    prompt_token_ids: list[int]   # the pair's prompt, or the two texts' prompts one after the other
    score: float


@dataclass
class ScoringPlan:
    """The pooling requests that score some pairs, and how their outputs become one score per pair."""
    prompts: list[str | dict]
    params: PoolingParams
    pair_rows: list[tuple[int, int]] | None   # embedding models: each pair's two prompts; None: one prompt a pair

    def scores(self, outputs: list[PoolingRequestOutput]) -> list[PairScore]:
        if self.pair_rows is None:
            return [PairScore(output.request_id, output.prompt_token_ids, float(output.outputs.data.item()))
                    for output in outputs]
        firsts, seconds = ([outputs[rows[side]] for rows in self.pair_rows] for side in (0, 1))
        cosines = F.cosine_similarity(torch.stack([o.outputs.data for o in firsts]).float(),
                                      torch.stack([o.outputs.data for o in seconds]).float(), dim=-1).tolist()
        return [PairScore(f"{first.request_id}_{second.request_id}", first.prompt_token_ids + second.prompt_token_ids,
                          cosine) for first, second, cosine in zip(firsts, seconds, cosines)]


def plan_scoring(tokenizer: Tokenizer, info: PoolingModelInfo | None, pairs: list[tuple[str, str]]) -> ScoringPlan:
    if info is None:
        raise ValueError("task score needs a pooling model (embedding or cross-encoder); this one generates text")
    if info.is_cross_encoder:
        return ScoringPlan([cross_encoder_prompt(tokenizer, info, query, document) for query, document in pairs],
                           PoolingParams(task="score"), None)
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    row_of = {text: row for row, text in enumerate(texts)}
    return ScoringPlan(texts, PoolingParams(), [(row_of[query], row_of[document]) for query, document in pairs])
