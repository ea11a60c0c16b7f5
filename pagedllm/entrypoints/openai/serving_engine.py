"""What every endpoint shares: the engine, the served model names, prompt checks, tracked generation."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import jinja2
from fastapi import Request

from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.protocol import EngineClient, EngineOverloadedError
from pagedllm.engine.request import CachePin
from pagedllm.engine.stats import EngineStats
from pagedllm.lora.request import LoRARequest
from pagedllm.entrypoints.openai.errors import APIError, api_error_for, sampling_field_named_in
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.entrypoints.openai.response_protocol import PromptTokensDetails, UsageInfo
from pagedllm.entrypoints.openai.serving_models import ServedAdapters
from pagedllm.entrypoints.openai.streams import merge_streams
from pagedllm.entrypoints.openai.tool_requests import ChatCompletionTool
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import Tokenizer


# transformers' apply_chat_template parameters: chat_template_kwargs holds template variables only.
_TEMPLATE_CALL_ARGUMENTS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass
class ServerState:
    llm: EngineClient
    model_names: list[str]      # the first is the one responses report
    metrics: ServerMetrics
    system_fingerprint: str
    salt_by_tenant: bool = False   # API keys name tenants (--api-keys-file): salt each tenant's cache blocks
    chat_template: str | None = None          # --chat-template's text, else the model's own
    tool_call_parser: str | None = None       # --tool-call-parser
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None       # --reasoning-parser
    adapters: ServedAdapters | None = None        # LoRA adapters served by name (with enable_lora)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.llm.tokenizer

    def resolve_model(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's model names, or None for a base model's name (or no name); any other
        name is a 404."""
        if name is None or name in self.model_names:
            return None
        adapters = self.adapters.all() if self.adapters is not None else []
        adapter = next((adapter for adapter in adapters if adapter.lora_name == name), None)
        if adapter is None:
            served = self.model_names + [adapter.lora_name for adapter in adapters]
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(map(repr, served))}", param="model", code="model_not_found")
        return adapter

    def check_model(self, name: str | None) -> None:
        """For endpoints of the base model alone (pooling): a base name or none."""
        if self.resolve_model(name) is not None:
            raise APIError(400, f"{name!r} is a LoRA adapter, which serves text generation only; name the base "
                                f"model ({', '.join(map(repr, self.model_names))}) here", param="model")

    def reported_model_name(self, adapter: LoRARequest | None) -> str:
        """The model an answer names: its adapter's, else the first served name (as vLLM reports them)."""
        return adapter.lora_name if adapter is not None else self.model_name

    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                        tools: list[ChatCompletionTool] | None = None,
                        chat_template_kwargs: dict | None = None) -> list[int]:
        """The conversation through the chat template (rendered sandboxed by the tokenizer), which gets the
        tools as `tools` (transformers' convention) and chat_template_kwargs as its own variables."""
        conversation = [message.as_template_message() for message in messages]
        kwargs = chat_template_kwargs or {}
        reserved = kwargs.keys() & _TEMPLATE_CALL_ARGUMENTS
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(sorted(reserved))} (arguments of the "
                                "template call itself)", param="chat_template_kwargs")
        tool_dicts = None if not tools else [tool.model_dump(exclude_none=True) for tool in tools]
        try:
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      chat_template=self.chat_template, tools=tool_dicts, **kwargs)
        except (ValueError, jinja2.TemplateError) as exc:   # no template, or it refused the conversation
            raise APIError(400, str(exc), param="messages") from exc

    def cache_salt(self, raw_request: Request, requested: str | None) -> str | None:
        """The salt a request's KV blocks are cached under. With tenants, the tenant's name and the
        request's own salt together (a JSON pair, so no choice of salt can equal another tenant's)."""
        if not self.salt_by_tenant:
            return requested
        return json.dumps([getattr(raw_request.state, "tenant", None), requested])

    def engine_prompt(self, token_ids: list[int], text: str | None, params: SamplingParams | BeamSearchParams,
                      param: str, cache_salt: str | None = None, cache_pins: list[CachePin] = ()) -> dict:
        """The engine's prompt, checked now (length, token ids, KV room, salt, pins) so a bad one is a 400, even
        before a stream has started; the engine's ValueError names the numbers."""
        prompt: dict = {"prompt_token_ids": token_ids}
        if text is not None:
            prompt["prompt"] = text
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        if cache_pins:
            prompt["cache_pins"] = list(cache_pins)
        try:
            self.llm.check_prompt(prompt, params)
        except ValueError as exc:
            raise APIError(400, str(exc), param=sampling_field_named_in(str(exc)) or param) from exc
        return prompt

    def generate(self, prompts: list[dict], params: SamplingParams | BeamSearchParams, request_ids: list[str],
                 priority: int = 0, lora_request: LoRARequest | None = None
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The prompts' output streams, merged. Refused with a 503 (Retry-After) now, before any answer
        has begun, when they would take the waiting requests past max_waiting_requests. A priority other
        than 0 needs the engine's priority policy (--scheduling-policy priority)."""
        if priority != 0 and self.llm.config.scheduling_policy != "priority":
            raise APIError(400, f"priority {priority} needs the server started with --scheduling-policy priority "
                                f"(it runs {self.llm.config.scheduling_policy!r}); send 0 or leave it out",
                           param="priority")
        try:
            self.llm.check_capacity(len(prompts))
        except EngineOverloadedError as exc:
            raise api_error_for(exc) from exc
        return merge_streams([self.metrics.track(self.llm.generate(prompt, params, request_id, priority,
                                                                   lora_request=lora_request))
                              for prompt, request_id in zip(prompts, request_ids)])

    async def engine_stats(self) -> EngineStats:
        """engine.stats() walks block tables that steps change, so it runs on the engine's own thread."""
        return await self.llm.stats()


@dataclass
class ChoiceState:
    """One choice as built up from the engine's outputs (DELTA kind, or one FINAL_ONLY output)."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # its prompt's, when asked
    num_cached_tokens: int = 0   # its prompt's tokens served from the prefix cache
    num_pinned_tokens: int = 0   # its prompt's tokens its cache pins hold (Anthropic's cache_control)

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


def usage(prompt_token_counts: list[int], rows: list[list[ChoiceState]]) -> UsageInfo:
    """Token counts of the prompts and of their rows of choices (a prompt is counted, and cached, once)."""
    prompt_tokens = sum(prompt_token_counts)
    completion_tokens = sum(len(choice.token_ids) for row in rows for choice in row)
    cached_tokens = sum(row[0].num_cached_tokens for row in rows if row)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def note_prompt_facts(row: list[ChoiceState], output: RequestOutput) -> None:
    """What an output says of its prompt, kept with each of the prompt's choices."""
    for choice in row:
        choice.num_cached_tokens = output.num_cached_tokens
        choice.num_pinned_tokens = output.num_pinned_tokens
        if output.prompt_logprobs is not None:
            choice.prompt_logprobs = output.prompt_logprobs


async def collect_choices(merged: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int,
                          n: int) -> list[list[ChoiceState]]:
    """Every prompt's n choices, built up until all of its requests have finished."""
    choices = [[ChoiceState() for _ in range(n)] for _ in range(num_prompts)]
    async for prompt_index, output in merged:
        for delta in output.outputs:
            choices[prompt_index][delta.index].add(delta)
        note_prompt_facts(choices[prompt_index], output)
    return choices


def has_news(choice: ChoiceState, delta: CompletionOutput) -> bool:
    """Whether a streamed delta is worth a chunk: a finished choice keeps appearing, empty, in its
    siblings' outputs, and a step may add a token whose text is still held back."""
    return choice.finish_reason is None and bool(delta.text or delta.token_ids or delta.finish_reason)
