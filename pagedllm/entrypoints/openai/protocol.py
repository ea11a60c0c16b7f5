"""Request bodies of the OpenAI API (and vLLM's extras), as pydantic models (the answers' are in
response_protocol.py).

Requests validate strictly (no "5" for 5, no true for 1) so that a wrong type is a 400
naming the field; value ranges are left to SamplingParams, which already checks them. Fields a
model does not declare are kept (extra="allow") for request_fields.py to judge: none is dropped unseen.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.input_processor import MAX_CACHE_SALT_CHARS
from pagedllm.entrypoints.openai.errors import APIError, sampling_field_named_in
from pagedllm.entrypoints.openai.structured_requests import StructuredOutputFields, structured_outputs_params
from pagedllm.entrypoints.openai.tool_requests import ChatCompletionTool, ToolCallParam, ToolChoice
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


# Request fields passed to SamplingParams under the same name, when the client sets them.
_SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                    "stop", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                    "allowed_token_ids", "bad_words", "prompt_logprobs")


# JSON may escape a lone UTF-16 surrogate ("\ud800"); Python's json module lets it into a str, which
# no tokenizer can encode and no response can carry back as UTF-8.
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _reject_lone_surrogates(value: Any) -> Any:
    if isinstance(value, str) and _LONE_SURROGATE.search(value):
        raise ValueError("text must be valid Unicode: lone surrogate escapes such as \\ud800 are not allowed")
    if isinstance(value, list):
        for item in value:
            _reject_lone_surrogates(item)
    if isinstance(value, dict):
        for key, item in value.items():
            _reject_lone_surrogates(key)
            _reject_lone_surrogates(item)
    return value


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    field_policy: ClassVar[str] = ""   # which table of request_fields.POLICIES judges undeclared fields

    # "*": every field of every request model, nested ones included, so the 400 names the field.
    _valid_unicode = field_validator("*")(_reject_lone_surrogates)


class StreamOptions(RequestModel):
    field_policy: ClassVar[str] = "stream_options"
    include_usage: bool = False


class SamplingRequest(RequestModel, StructuredOutputFields):
    """Fields shared by completions and chat; the sampling ones map onto SamplingParams fields of the same name."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Requests share prefix-cache blocks only with requests of the same salt (and tenant).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    logit_bias: dict[str, float] | None = None   # OpenAI's: token id (as a string) -> bias in [-100, 100]
    # vLLM's logit controls and prompt logprobs
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # vLLM's: the scheduling priority (lower runs first) under --scheduling-policy priority
    priority: int = 0
    return_tokens_as_token_ids: bool | None = None   # vLLM's: logprobs name tokens as "token_id:N"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, aliases: dict[str, str] | None = None, **overrides) -> SamplingParams:
        """SamplingParams from the fields the client set, plus overrides; its ValueError becomes a 400
        naming the field (as the client called it: aliases maps SamplingParams names to request names)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        values = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        if self.logit_bias is not None:
            values["logit_bias"] = self._logit_bias_by_id()
        requested = self.requested_structured_outputs()
        if requested is not None:
            if overrides.get("structured_outputs") is not None:
                raise APIError(400, f"{requested[0]} cannot be combined with a required or named tool_choice "
                                    "(the tool's schema constrains the output)", param=requested[0])
            overrides["structured_outputs"] = structured_outputs_params(*requested)
        values = {"output_kind": RequestOutputKind.DELTA, **values, **overrides}
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            message = str(exc)
            field = sampling_field_named_in(message)
            if field is None:
                raise APIError(400, message) from exc
            param = (aliases or {}).get(field, field)
            raise APIError(400, param + message[len(field):], param=param) from exc


    def _logit_bias_by_id(self) -> dict[int, float]:
        """OpenAI sends token ids as JSON object keys, that is as strings."""
        try:
            return {int(key): value for key, value in self.logit_bias.items()}
        except ValueError:
            bad = next(key for key in self.logit_bias if not key.lstrip("-").isdigit())
            raise APIError(400, f"logit_bias keys must be token ids (integers), got {bad!r:.80}",
                           param="logit_bias") from None


class CompletionRequest(SamplingRequest):
    field_policy: ClassVar[str] = "completions"
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16   # OpenAI's default for completions
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    # vLLM's extras: beam search with n beams, the best first
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def to_sampling_params(self) -> SamplingParams | BeamSearchParams:
        if self.use_beam_search:
            return self._beam_search_params()
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        overrides = {}
        if self.echo and self.logprobs is not None:   # the legacy shape: the prompt's logprobs come first
            overrides["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        if self.echo_only:   # lm-eval's loglikelihood: one token is generated, and left out of the answer
            overrides["max_tokens"] = 1
        # DELTA outputs cannot pick the best of best_of samples (known only at the end): a whole
        # answer then comes as one FINAL_ONLY output; streaming it stays refused by SamplingParams.
        picks_best = not self.stream and (self.best_of or self.n) > self.n
        return self.sampling_params(best_of=self.best_of, logprobs=self.logprobs,
                                    output_kind=RequestOutputKind.FINAL_ONLY if picks_best else RequestOutputKind.DELTA,
                                    **overrides)

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo (vLLM's meaning): the answer is the prompt alone, with its logprobs."""
        return self.echo and self.max_tokens == 0


    def _beam_search_params(self) -> BeamSearchParams:
        """n beams, max_tokens, ignore_eos and length_penalty; a sampling field beam search cannot honour
        is a 400 naming it, not ignored (temperature 0 is what beam search does anyway)."""
        allowed = {"n", "max_tokens", "ignore_eos", "temperature"}
        for name in (*_SAMPLING_FIELDS, "best_of", "logprobs", "logit_bias", "suffix", "prompt_logprobs"):
            if name not in allowed and getattr(self, name) is not None:
                raise APIError(400, f"{name} cannot be used with use_beam_search", param=name)
        if self.temperature not in (None, 0):
            raise APIError(400, "temperature must be 0 (or unset) with use_beam_search", param="temperature")
        if self.max_tokens is None:
            raise APIError(400, "max_tokens is required with use_beam_search", param="max_tokens")
        requested = self.requested_structured_outputs()
        if requested is not None:
            raise APIError(400, f"{requested[0]} cannot be used with use_beam_search", param=requested[0])
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=self.max_tokens, ignore_eos=bool(self.ignore_eos),
                                    length_penalty=self.length_penalty)
        except ValueError as exc:
            message = str(exc).replace("beam_width", "n", 1)
            raise APIError(400, message, param=message.split(" ", 1)[0]) from exc


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    field_policy: ClassVar[str] = "message"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None   # assistant messages
    tool_call_id: str | None = None                 # tool messages: the call they answer

    def as_template_message(self) -> dict:
        """What the chat template reads: text parts are joined with newlines, as vLLM does; `developer` (OpenAI's
        new name for system) as `system`, which templates know; calls with their arguments as objects."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise APIError(400, f"content is required in {self.role} messages (only an assistant message with "
                                "tool_calls may leave it out)", param="messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise APIError(400, "tool messages need the tool_call_id they answer", param="messages")
        content = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_call() for call in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(SamplingRequest):
    field_policy: ClassVar[str] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True   # vLLM's extra
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM's: extra variables for the chat template
    include_reasoning: bool = True   # vLLM's: with --reasoning-parser, return reasoning_content

    def to_sampling_params(self, forced_tool_schema: dict | None = None) -> SamplingParams:
        """max_completion_tokens is OpenAI's new name for max_tokens and wins over it; without either,
        the answer may fill the model's context. forced_tool_schema: the grammar of a required or named
        tool_choice."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        aliases = {"logprobs": "top_logprobs"}
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
            aliases["max_tokens"] = "max_completion_tokens"
        forced = None if forced_tool_schema is None else structured_outputs_params("tool_choice",
                                                                                  {"json": forced_tool_schema})
        return self.sampling_params(aliases, max_tokens=max_tokens, structured_outputs=forced,
                                    logprobs=(self.top_logprobs or 0) if self.logprobs else None)


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    tools: list[ChatCompletionTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's POST /v1/load_lora_adapter body."""
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """vLLM's POST /v1/unload_lora_adapter body; lora_int_id, when given, must be the named adapter's id."""
    lora_name: str
    lora_int_id: int | None = None
