"""Request and response bodies of the pooling routes: OpenAI's /v1/embeddings, and vLLM's /v1/score and
/v1/rerank (the Jina / Cohere rerank shape)."""
from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import RequestModel

TokenIds = list[int]


class EmbeddingRequest(RequestModel):
    field_policy: ClassVar[str] = "pooling"
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    # vLLM's extras
    normalize: bool | None = None
    add_special_tokens: bool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str   # a base64 string of little-endian float32 with encoding_format base64


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class PoolingListResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: PoolingUsage


class EmbeddingResponse(PoolingListResponse):
    data: list[EmbeddingData]


class ScoreRequest(RequestModel):
    """vLLM's: text_1 against each of text_2 (one text), or the two lists pairwise."""
    field_policy: ClassVar[str] = "pooling"
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(PoolingListResponse):
    data: list[ScoreData]


class RerankRequest(RequestModel):
    """Jina's / Cohere's: the documents ranked by relevance to the query, the top_n first ones returned."""
    field_policy: ClassVar[str] = "pooling"
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None   # None (or vLLM's 0): every document
    return_documents: bool = True


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
