"""What generate() returns, in vLLM's shape so code written against vLLM reads it unchanged."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # When asked: None for the first prompt token, then each token's {id: Logprob} (it and the top-k).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    num_pinned_tokens: int = 0   # prompt tokens its cache pins hold in the prefix cache (see CachePin)
    error: str | None = None   # set when the request failed inside the engine (finish_reason "error")


@dataclass
class PoolingOutput:
    """A pooling model's result for one prompt: the embedding, or a cross-encoder's score as one value."""
    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """What LLM.encode / the engine return for a pooling request (vLLM's shape)."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None   # set when the request failed inside the engine


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result: `.outputs.embedding` is the vector."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """LLM.score's result for one pair: `.outputs.score`."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
