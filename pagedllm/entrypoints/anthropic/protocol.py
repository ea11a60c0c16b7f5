"""Request and response bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

Requests validate strictly, as the OpenAI routes' do; fields the models do not declare go to
request_fields.py (the "anthropic" table). Content blocks and tools are told apart by their `type`;
kinds this server cannot take are kept by type alone, to be refused by name.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from pagedllm.entrypoints.openai.protocol import RequestModel
from pagedllm.entrypoints.openai.structured_requests import StrictModel

# ---- request ----


class CacheControl(StrictModel):
    """A breakpoint: the prompt prefix up to and including this block stays in the prefix cache for the ttl
    (5 minutes unless "1h"), within --max-pinned-kv-cache-fraction of the KV pool."""
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(RequestModel):
    field_policy: ClassVar[str] = "anthropic_block"
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(RequestModel):
    field_policy: ClassVar[str] = "anthropic_block"
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(RequestModel):
    field_policy: ClassVar[str] = "anthropic_block"
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(block.text for block in self.content)
        return self.content or ""


class ThinkingBlock(RequestModel):
    """An earlier answer's thinking passed back: chat templates do not read it, so it is dropped."""
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class OtherBlock(BaseModel):
    """Images, documents, search results...: recognised only to be refused by name."""
    type: str


def _type_of(value: Any) -> str | None:
    field = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return field if isinstance(field, str) else None


_BLOCK_TAGS = {"text": "text", "tool_use": "tool_use", "tool_result": "tool_result", "thinking": "thinking",
               "redacted_thinking": "thinking"}
ContentBlock = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
                         | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
                         | Annotated[OtherBlock, Tag("other")],
                         Discriminator(lambda value: _BLOCK_TAGS.get(_type_of(value), "other")
                                       if _type_of(value) is not None else None)]


class MessageParam(RequestModel):
    field_policy: ClassVar[str] = "anthropic_block"
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class CustomTool(StrictModel):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ServerTool(BaseModel):
    """Anthropic's own tools (web_search_20250305, bash_20250124, ...): recognised only to be refused by name."""
    type: str


AnthropicTool = Annotated[Annotated[CustomTool, Tag("custom")] | Annotated[ServerTool, Tag("server")],
                          Discriminator(lambda value: "custom" if _type_of(value) in (None, "custom") else "server")]


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    format: JsonOutputFormat | None = None   # structured output, through the same grammar as chat's
    effort: str | None = None                # refused: the effort cannot be set


class Metadata(StrictModel):
    user_id: str | None = None


class CountTokensRequest(RequestModel):
    field_policy: ClassVar[str] = "anthropic"
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None  # marks the last block (one of the 4 breakpoints)
    output_config: OutputConfig | None = None
    speed: Literal["standard"] | None = None   # one speed: "fast" is not a mode this server has


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None   # one tier: a no-op
    inference_geo: str | None = None           # where it runs is where this server is: a no-op


# ---- response ----

class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""   # unsigned: this server's thinking is the model's own text


class AnthropicUsage(BaseModel):
    """Anthropic's split: input_tokens are the prompt tokens not read from the cache."""
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextOut | ToolUseOut | ThinkingOut] = Field(default_factory=list)
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, which every failure on these routes carries (errors.error_body builds it)."""
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


ANTHROPIC_ERROR_RESPONSES = {
    "4XX": {"model": AnthropicErrorResponse, "description": "The request was refused; the body says why"},
    "5XX": {"model": AnthropicErrorResponse, "description": "The engine failed the request or is shutting down"}}
