"""The pooling routes: POST /v1/embeddings (OpenAI's), /v1/score and /v1/rerank (vLLM's; the rerank shape is
Jina's and Cohere's, also served at /rerank and /v2/rerank). One engine request per prompt, answered whole."""
from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import APIRouter, Request, Response

from pagedllm.engine.protocol import EngineOverloadedError
from pagedllm.entrypoints.openai.errors import APIError, api_error_for
from pagedllm.entrypoints.openai.pooling_protocol import (EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                                          PoolingUsage, RerankDocument, RerankRequest, RerankResponse,
                                                          RerankResult, RerankUsage, ScoreData, ScoreRequest,
                                                          ScoreResponse)
from pagedllm.entrypoints.openai.response_protocol import ERROR_RESPONSES
from pagedllm.entrypoints.openai.request_fields import check_undeclared_fields
from pagedllm.entrypoints.openai.serving_engine import ServerState
from pagedllm.entrypoints.openai.streams import merge_streams, unless_disconnected
from pagedllm.entrypoints.score_utils import PairScore, pair_up, plan_scoring
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _param_named_in(message: str, default: str) -> str:
    """The request field an engine check's message is about."""
    first = message.split(" ", 1)[0]
    if first in ("dimensions", "normalize"):
        return first
    return "model" if first == "task" else default


def _checked(state: ServerState, prompt: str | dict, params: PoolingParams, param: str) -> str | dict:
    """The prompt, checked now (model kind, length, token ids, KV room) so that a bad one is a 400."""
    try:
        state.llm.check_pooling_prompt(prompt, params)
    except ValueError as exc:
        raise APIError(400, str(exc), param=_param_named_in(str(exc), param)) from exc
    return prompt


async def _pool(state: ServerState, raw_request: Request, prompts: list, params: PoolingParams,
                request_id: str) -> list[PoolingRequestOutput] | None:
    """Every prompt's output in order; None if the client left (its requests are aborted)."""
    try:
        state.llm.check_capacity(len(prompts))
    except EngineOverloadedError as exc:
        raise api_error_for(exc) from exc
    merged = merge_streams([state.llm.encode(prompt, params, f"{request_id}-{index}")
                            for index, prompt in enumerate(prompts)])

    async def collect() -> list[PoolingRequestOutput]:
        outputs = [None] * len(prompts)
        async for index, output in merged:
            outputs[index] = output
        return outputs

    outputs = await unless_disconnected(raw_request, collect())
    if outputs is not None:
        state.metrics.prompt_tokens.inc(sum(len(output.prompt_token_ids) for output in outputs))
    return outputs


def _embedding_prompts(body: EmbeddingRequest, state: ServerState) -> list[dict]:
    """A string, a list of strings, token ids or a list of those: one prompt each."""
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs or any(not item for item in inputs):
        raise APIError(400, "input must not be empty, nor hold an empty string or empty token list", param="input")
    return [{"prompt_token_ids": state.tokenizer.encode(item, add_special_tokens=body.add_special_tokens)}
            if isinstance(item, str) else {"prompt_token_ids": item} for item in inputs]


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """base64: the little-endian float32 bytes, as OpenAI's API sends them (and its client decodes them)."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


@router.post("/v1/embeddings", responses=ERROR_RESPONSES)
async def create_embedding(body: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
    state = _state(raw_request)
    check_undeclared_fields(body)
    state.check_model(body.model)
    try:
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    except ValueError as exc:
        raise APIError(400, str(exc), param=_param_named_in(str(exc), "input")) from exc
    prompts = [_checked(state, prompt, params, "input") for prompt in _embedding_prompts(body, state)]
    request_id = f"embd-{uuid.uuid4().hex}"
    outputs = await _pool(state, raw_request, prompts, params, request_id)
    if outputs is None:
        return Response(status_code=499)   # the client left; nobody reads this
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return EmbeddingResponse(id=request_id, model=state.model_name, usage=PoolingUsage(prompt_tokens=num_tokens,
                                                                                       total_tokens=num_tokens),
                             data=[EmbeddingData(index=index, embedding=_encoded(output.outputs.data.tolist(),
                                                                                  body.encoding_format))
                                   for index, output in enumerate(outputs)])


async def _score_pairs(state: ServerState, raw_request: Request, first: str | list[str], second: str | list[str],
                       names: tuple[str, str], request_id: str) -> tuple[list[PairScore], int] | None:
    """Each pair's score and the prompt tokens computed for them (an embedding model embeds each text once);
    None if the client left."""
    try:
        pairs = pair_up(first, second, names=names)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from exc
    try:
        plan = plan_scoring(state.tokenizer, state.llm.pooling, pairs)
    except ValueError as exc:
        raise APIError(400, str(exc), param="model") from exc
    prompts = [_checked(state, prompt, plan.params, names[1]) for prompt in plan.prompts]
    outputs = await _pool(state, raw_request, prompts, plan.params, request_id)
    if outputs is None:
        return None
    return plan.scores(outputs), sum(len(output.prompt_token_ids) for output in outputs)


@router.post("/v1/score", responses=ERROR_RESPONSES)
async def create_score(body: ScoreRequest, raw_request: Request) -> ScoreResponse:
    state = _state(raw_request)
    check_undeclared_fields(body)
    state.check_model(body.model)
    request_id = f"score-{uuid.uuid4().hex}"
    scored = await _score_pairs(state, raw_request, body.text_1, body.text_2, ("text_1", "text_2"), request_id)
    if scored is None:
        return Response(status_code=499)   # the client left; nobody reads this
    scores, num_tokens = scored
    return ScoreResponse(id=request_id, model=state.model_name,
                         data=[ScoreData(index=index, score=pair.score) for index, pair in enumerate(scores)],
                         usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


@router.post("/v1/rerank", responses=ERROR_RESPONSES)
@router.post("/v2/rerank", responses=ERROR_RESPONSES, include_in_schema=False)
@router.post("/rerank", responses=ERROR_RESPONSES, include_in_schema=False)
async def rerank(body: RerankRequest, raw_request: Request) -> RerankResponse:
    state = _state(raw_request)
    check_undeclared_fields(body)
    state.check_model(body.model)
    if body.top_n is not None and body.top_n < 0:
        raise APIError(400, f"top_n must be >= 0 (0: every document), got {body.top_n}", param="top_n")
    request_id = f"rerank-{uuid.uuid4().hex}"
    scored = await _score_pairs(state, raw_request, body.query, body.documents, ("query", "documents"), request_id)
    if scored is None:
        return Response(status_code=499)
    scores, num_tokens = scored
    ranked = sorted(range(len(scores)), key=lambda index: scores[index].score, reverse=True)
    top_n = body.top_n or len(ranked)
    return RerankResponse(id=request_id, model=state.model_name, usage=RerankUsage(total_tokens=num_tokens),
                          results=[RerankResult(index=index, relevance_score=scores[index].score,
                                                document=RerankDocument(text=body.documents[index])
                                                if body.return_documents else None)
                                   for index in ranked[:top_n]])
