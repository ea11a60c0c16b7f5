"""Request and response bodies of OpenAI's Responses API (POST /v1/responses), as pydantic models.

Requests validate strictly, as chat's do; fields the models do not declare go to request_fields.py
(the "responses" table). Input items and tools are unions told apart by their `type`.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from pagedllm.engine.input_processor import MAX_CACHE_SALT_CHARS
from pagedllm.entrypoints.openai.protocol import RequestModel, StreamOptions
from pagedllm.entrypoints.openai.structured_requests import StrictModel

# ---- request ----


class InputText(RequestModel):
    type: Literal["input_text", "output_text", "text"]   # output_text: an earlier answer passed back
    text: str


class InputMessage(RequestModel):
    """A message item, or OpenAI's "easy" message ({role, content} without a type)."""
    field_policy: ClassVar[str] = "responses_item"
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(RequestModel):
    field_policy: ClassVar[str] = "responses_item"
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    field_policy: ClassVar[str] = "responses_item"
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningItem(RequestModel):
    """An earlier answer's reasoning passed back: chat templates do not read it, so it is dropped."""
    field_policy: ClassVar[str] = "responses_item"
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _type_of(value: Any, default: str) -> str:
    field = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return field if isinstance(field, str) else default


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")],
                      Discriminator(lambda value: _type_of(value, "message"))]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # the grammar enforces the schema for required and named choices anyway


class BuiltInTool(BaseModel):
    """OpenAI's hosted tools (web_search, file_search, ...): recognised only to be refused by name."""
    type: str


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[BuiltInTool, Tag("built-in")],
                 Discriminator(lambda value: "function" if _type_of(value, "") == "function" else "built-in")]


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    field_policy: ClassVar[str] = "responses"
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None


# ---- response ----

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0   # not counted: the prefix cache keeps every prompt's full blocks at no charge


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    truncation: Literal["disabled"] = "disabled"


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
