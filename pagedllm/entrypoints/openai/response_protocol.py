"""The bodies the OpenAI-compatible server answers with (and vLLM's extras), as pydantic models: errors, usage,
completions, chat completions and their stream chunks, models, tokenize. Requests are in protocol.py; the
Responses API's own bodies in responses/protocol.py."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every failure carries (errors.error_body builds it); for the OpenAPI schema."""
    error: ErrorInfo


# The OpenAPI schema documents every answer the routes give, so clients and schema-driven fuzzers
# (schemathesis) can rely on it: failures are OpenAI's error body with 400 (not FastAPI's 422),
# 401 (API key), 404 (model), 413 (body size); 5xx only when the engine fails or shuts down.
ERROR_RESPONSES = {"4XX": {"model": ErrorResponse, "description": "The request was refused; the body says why"},
                   "5XX": {"model": ErrorResponse, "description": "The engine failed the request or is shutting down"}}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """With echo the prompt's tokens come first; the first has no logprob (null), as in OpenAI's legacy API."""
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    # Where the text after the last token starts (tokens may be named "token_id:N", so not their length).
    _end_offset: int = PrivateAttr(default=0)

    @property
    def end_offset(self) -> int:
        return self._end_offset


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry, under the token id."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None   # vLLM's: the stop string or token id that ended the text
    prompt_logprobs: PromptLogprobsField = None   # vLLM's extra, when asked


class CompletionResponse(BaseModel):
    """Both the whole answer and each streamed chunk (OpenAI uses one shape for both)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str   # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a call: the first of each index carries id, type and name."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None   # with --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsField = None   # vLLM's extra, when asked


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsField = None   # vLLM's extra, when asked: in the first chunk with content


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str
    parent: str | None = None   # an adapter's base model; None for a base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
