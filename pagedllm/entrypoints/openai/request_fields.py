"""What becomes of request fields that no request model declares: none is dropped without a word.

A declared field is honoured by the code that reads it, so declaring a field in protocol.py is all it
takes to honour it (its entry here is then never consulted). An undeclared field that OpenAI's or
vLLM's API defines is either accepted as a documented no-op (it changes nothing about the output) or
refused with a 400 naming it; any other field is logged once per name and ignored, as vLLM does.
docs/serving.md ("Request fields") lists them all.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class NoOp:
    """A field accepted because it cannot change the output; `accepts` says which values are harmless."""
    accepts: Callable[[Any], bool] = lambda value: True
    allowed: str = ""   # the harmless values, for the error when another one comes


@dataclass(frozen=True)
class Refused:
    """A field that would change the output in a way this server cannot; sent at its no-op value
    (null, false, its default: `harmless`) it changes nothing and is accepted."""
    reason: str
    harmless: tuple = (None,)


_TEXT_ONLY = NoOp(lambda value: value in (None, ["text"]), 'null or ["text"]')
_DEFAULT_TIER = NoOp(lambda value: value in (None, "auto", "default"), 'null, "auto" or "default"')
_NOT_STORED = NoOp(lambda value: value in (None, False), "false (this server keeps no completions)")
_SHARED: dict[str, NoOp | Refused] = {
    "user": NoOp(), "safety_identifier": NoOp(), "prompt_cache_key": NoOp(),   # identify the caller, or hint caching
    "metadata": NoOp(), "store": _NOT_STORED, "service_tier": _DEFAULT_TIER,
    # vLLM's extras this engine does not implement: each would change the output.
    "truncate_prompt_tokens": Refused("prompts are never truncated; shorten the prompt"),
    "logits_processors": Refused("custom logits processors are not implemented", (None, [])),
    "guided_decoding_backend": NoOp(lambda value: value in (None, "auto", "xgrammar"),
                                    'null, "auto" or "xgrammar" (the one grammar backend)'),
}
POLICIES: dict[str, dict[str, NoOp | Refused]] = {
    "completions": {**_SHARED, "add_special_tokens": Refused("send prompt token ids to control special tokens",
                                                             (None, True))},
    "chat": {
        **_SHARED,
        "audio": Refused("this server generates text only"),
        "modalities": _TEXT_ONLY,
        "prediction": Refused("predicted outputs are not implemented"),
        "web_search_options": Refused("this server has no web search"),
        "verbosity": Refused("the model cannot be told how long to answer"),
        "reasoning_effort": Refused("the effort cannot be set; chat_template_kwargs (e.g. enable_thinking) reach "
                                    "the template"),
        "functions": Refused("the deprecated functions API is not supported; send tools and tool_choice"),
        "function_call": Refused("the deprecated functions API is not supported; send tools and tool_choice"),
        "chat_template": Refused("per-request templates are not supported; start the server with --chat-template"),
        "continue_final_message": Refused("a final assistant message cannot be continued", (None, False)),
        "documents": Refused("documents are not passed to chat templates", (None, [])),
        "add_special_tokens": Refused("the chat template places the special tokens", (None, False)),
        "echo": Refused("echo exists on /v1/completions only", (None, False)),
        "use_beam_search": Refused("beam search exists on /v1/completions only", (None, False)),
        "length_penalty": Refused("beam search exists on /v1/completions only", (None, 1.0, 1)),
        "best_of": Refused("best_of exists on /v1/completions only", (None, 1)),
    },
    "message": {
        "refusal": NoOp(), "reasoning_content": NoOp(),   # an earlier answer's: templates do not read them
        "audio": Refused("this server takes text only"),
        "function_call": Refused("the deprecated functions API is not supported; send tool_calls"),
    },
    "stream_options": {"include_obfuscation": NoOp()},
    "responses": {
        "safety_identifier": NoOp(), "prompt_cache_key": NoOp(), "service_tier": _DEFAULT_TIER,
        "truncate_prompt_tokens": _SHARED["truncate_prompt_tokens"], "logits_processors": _SHARED["logits_processors"],
        "top_logprobs": Refused("logprobs are not returned by /v1/responses; use /v1/chat/completions", (None, 0)),
        "max_tool_calls": Refused("the number of tool calls cannot be bounded; parallel_tool_calls false allows one"),
        "prompt": Refused("stored prompt templates are not supported; send instructions and input"),
        "conversation": Refused("conversations are not stored; chain responses with previous_response_id"),
    },
    "responses_item": {},
    "anthropic": {
        "container": Refused("this server runs no code containers"),
        "mcp_servers": Refused("this server connects to no MCP servers", (None, [])),
        "context_management": Refused("the context is never edited; send the messages to keep"),
    },
    "anthropic_block": {"citations": NoOp()},   # an earlier answer's: templates do not read them
    # /v1/embeddings, /v1/score, /v1/rerank
    "pooling": {
        "user": NoOp(),
        "truncate_prompt_tokens": _SHARED["truncate_prompt_tokens"],
        "priority": Refused("pooling requests are not scheduled by priority", (None, 0)),
        "softmax": Refused("a cross-encoder's score takes the activation it was saved with"),
        "activation": Refused("a cross-encoder's score takes the activation it was saved with"),
        "instruction": Refused("prepend the instruction to the text"),
    },
}

_logged: set[tuple[str, str]] = set()


def _is_harmless(value: Any, harmless: tuple) -> bool:
    """Equal in type as well as value: 1 is not true, and 0 is not false."""
    return any(value == allowed and type(value) is type(allowed) for allowed in harmless)


def check_undeclared_fields(body: BaseModel, path: str = "") -> None:
    """Walks the request (nested models too): refuses what must be refused with a 400 naming the field,
    logs each unknown field name once."""
    policy = POLICIES.get(getattr(body, "field_policy", ""), {})
    for name, value in (body.model_extra or {}).items():
        param = f"{path}{name}"
        rule = policy.get(name)
        if isinstance(rule, Refused):
            if _is_harmless(value, rule.harmless):
                continue
            raise APIError(400, f"{param} is not supported: {rule.reason}", param=param)
        if isinstance(rule, NoOp):
            if not rule.accepts(value):
                raise APIError(400, f"{param} must be {rule.allowed}, got {value!r:.80}", param=param)
            continue
        if (type(body).__name__, name) not in _logged:
            _logged.add((type(body).__name__, name))
            logger.warning("ignoring the unknown field %r in a %s", name, type(body).__name__)
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, BaseModel):
                suffix = f".{index}" if isinstance(value, list) else ""
                check_undeclared_fields(item, f"{path}{name}{suffix}.")
