"""Pooling requests in the engine: one prompt, computed whole in one step, answered by its pooled row.

A pooling request is a plain Request to the scheduler: it takes blocks when admitted, runs its prefill,
and the scheduler finishes it (freeing its blocks) in the step that pooled it. Its sampling params are the
defaults, never read: nothing is sampled.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.engine.request import Request
from pagedllm.model.pooler import finish_embedding
from pagedllm.model.pooling_checkpoint import PoolingModelInfo
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

_SCORE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "identity": lambda logits: logits}


def check_pooling_params(params: PoolingParams, info: PoolingModelInfo | None) -> None:
    """ValueError unless this model can answer the request: embeddings from embedding models (dimensions
    from Matryoshka ones), scores from one-label cross-encoders."""
    if info is None:
        raise ValueError(f"task {params.task} needs a pooling model (embedding or cross-encoder); this one "
                         "generates text (see runner)")
    if params.task == "embed":
        if info.is_cross_encoder:
            raise ValueError("task embed is not supported by this model: it is a cross-encoder (it scores pairs)")
        info.check_dimensions(params.dimensions)
        return
    if not info.is_cross_encoder:
        raise ValueError("task score needs a cross-encoder; embedding models are scored by the cosine of their "
                         "embeddings (LLM.score and /v1/score do so)")
    if info.num_labels != 1:
        raise ValueError(f"task score needs a classifier with one label, this one has {info.num_labels}")
    if params.dimensions is not None or params.normalize is not None:
        raise ValueError("dimensions and normalize apply to embeddings, not to scores")


def check_token_type_ids(token_type_ids, num_tokens: int, info: PoolingModelInfo | None) -> list[int]:
    """A prompt's token types (segment ids of a pair), for encoders that have them."""
    types = info.encoder.type_vocab_size if info is not None and info.encoder is not None else 0
    if types < 2:
        raise ValueError("token_type_ids are taken by BERT-style encoders with several token types only")
    if not (isinstance(token_type_ids, list) and len(token_type_ids) == num_tokens and all(
            isinstance(kind, int) and not isinstance(kind, bool) and 0 <= kind < types for kind in token_type_ids)):
        raise ValueError(f"token_type_ids must be a list of {num_tokens} integers (one per token) in [0, {types})")
    return token_type_ids


class PoolingParent:
    """One pooling request as the engine tracks it, until its pooled row arrives."""

    def __init__(self, request: Request, prompt_token_ids: list[int], params: PoolingParams, info: PoolingModelInfo):
        self.request_id = request.request_id
        self.request = request
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.info = info
        self.data: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.request.is_finished

    def unfinished_requests(self) -> list[Request]:
        return [] if self.finished else [self.request]

    def take(self, pooled: np.ndarray) -> None:
        """The runner's row: an embedding is finished (truncated, normalised); a logit becomes a score."""
        row = torch.from_numpy(pooled)
        if self.params.task == "score":
            self.data = _SCORE_ACTIVATIONS[self.info.score_activation](row)
            return
        normalize = self.info.pooler.normalize if self.params.normalize is None else self.params.normalize
        self.data = finish_embedding(row, self.params.dimensions, normalize)

    def make_output(self) -> PoolingRequestOutput | None:
        if not self.finished:
            return None
        return PoolingRequestOutput(self.request_id, PoolingOutput(self.data), self.prompt_token_ids, True,
                                    self.request.error)
