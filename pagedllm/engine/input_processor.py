"""From a user's prompt and params to scheduler requests: tokenize, check, cache salt and pins, fan out
n / best_of samples, beams and pooling (vLLM's input Processor)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pagedllm.engine.bad_words import bad_words_token_ids
from pagedllm.engine.beam_search import BeamSearch, BeamSearchParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.lora_adapters import EngineLoRAAdapters, lora_cache_salt
from pagedllm.engine.output_processor import BeamSearchParent, ChildState, ParentRequest
from pagedllm.engine.pooling import PoolingParent, check_pooling_params, check_token_type_ids
from pagedllm.engine.request import CachePin, Request
from pagedllm.kv.manager import KVCacheManager
from pagedllm.lora.request import LoRARequest
from pagedllm.model.bert import with_token_types
from pagedllm.model.config import ModelConfig
from pagedllm.model.pooling_checkpoint import PoolingModelInfo
from pagedllm.model.rope_scaling import rope_length_key
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import Tokenizer

PromptType = str | dict
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "cache_pins"})
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt that can run: its text (if it had one), token ids, the max_tokens it gets, its cache salt and
    the prefixes it pins."""
    text: str | None
    token_ids: list[int]
    max_tokens: int
    cache_salt: str | None
    cache_pins: tuple[CachePin, ...] = ()


@dataclass(frozen=True)
class NewRequest:
    """A user request ready to queue: what the output processor tracks, and what the scheduler runs
    (the first request, and the parallel samples forked from it when it first samples)."""
    parent: ParentRequest | BeamSearchParent | PoolingParent
    first: Request
    siblings: list[Request]


def cache_salt_of(prompt: PromptType) -> str | None:
    """vLLM's `cache_salt` prompt key: a non-empty string, or absent."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                         f"got {salt!r:.80}")
    return salt


def tokenize_prompt(prompt: PromptType, tokenizer: Tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """A prompt's text (if it has one) and token ids; ValueError naming what is wrong with it."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict) and not prompt.keys() <= PROMPT_KEYS:
        raise ValueError(f"prompt keys must be among {', '.join(sorted(PROMPT_KEYS))}, "
                         f"got {', '.join(sorted(map(str, prompt.keys() - PROMPT_KEYS)))}")
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be a list of integers in [0, {vocab_size})")
        return prompt.get("prompt"), list(ids)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"], tokenizer.encode(prompt["prompt"])
    raise ValueError("prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]} "
                     f"(either with an optional 'cache_salt' and 'cache_pins'), got {type(prompt).__name__}")


def prefix_cache_salt(cache_salt: str | None, model_config: ModelConfig, num_prompt_tokens: int,
                      max_model_len: int) -> str | None:
    """The key a prompt's first KV block is cached under beside its tokens: the request's cache salt, and for
    K/V that depend on the prompt's length (some rope scalings) that length's key, so they are shared only
    at that length."""
    rope_key = rope_length_key(model_config.rope_scaling, num_prompt_tokens, max_model_len)
    return cache_salt if rope_key is None else f"{cache_salt or ''}\x00{rope_key}"


def cache_pins_of(prompt: PromptType, num_prompt_tokens: int, enable_prefix_caching: bool) -> tuple[CachePin, ...]:
    """The `cache_pins` prompt key: CachePins within the prompt, with a positive, finite ttl_s."""
    pins = prompt.get("cache_pins") if isinstance(prompt, dict) else None
    if not pins:
        return ()
    if not enable_prefix_caching:
        raise ValueError("cache_pins keep prefixes in the prefix cache, which this engine runs without "
                         "(enable_prefix_caching=False)")
    if not isinstance(pins, (list, tuple)) or not all(isinstance(pin, CachePin) for pin in pins):
        raise ValueError(f"cache_pins must be a list of CachePin, got {pins!r:.80}")
    for pin in pins:
        if not (isinstance(pin.num_tokens, int) and 0 <= pin.num_tokens <= num_prompt_tokens):
            raise ValueError(f"cache_pins: num_tokens must be an integer from 0 to the prompt's {num_prompt_tokens} "
                             f"tokens, got {pin.num_tokens!r}")
        if not (isinstance(pin.ttl_s, (int, float)) and 0 < pin.ttl_s < math.inf):
            raise ValueError(f"cache_pins: ttl_s must be a positive number of seconds, got {pin.ttl_s!r}")
    return tuple(pins)


class InputProcessor:
    """Checks requests against the model and the KV cache's fixed limits (never its current state, so a check
    can run off the engine thread) and builds their scheduler requests."""

    def __init__(self, tokenizer, model_config: ModelConfig, max_model_len: int, kv_manager: KVCacheManager,
                 structured_output: StructuredOutputManager, pooling: PoolingModelInfo | None,
                 lora: EngineLoRAAdapters):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.kv_manager = kv_manager
        self.structured_output = structured_output
        self.pooling = pooling   # None: a generating model
        self.lora = lora

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams | PoolingParams,
                arrival_time: float, priority: int, lora_request: LoRARequest | None = None) -> NewRequest:
        """Validates a request and fans it out; raises ValueError (naming the numbers) if it can never run.
        lora_request: the adapter it runs with (loaded now if it is not yet); None: the base model."""
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request applies to generation, not to pooling requests")
            return self._pooling_request(request_id, prompt, params, arrival_time, priority)
        checked = self.check_prompt(prompt, params)
        self.lora.check_request(lora_request)
        checked = dataclasses.replace(checked, cache_salt=lora_cache_salt(checked.cache_salt, lora_request))
        if isinstance(params, BeamSearchParams):
            search = BeamSearch(request_id, checked.token_ids, params, self.model_config.eos_token_ids,
                                checked.max_tokens, checked.cache_salt, arrival_time, priority, lora_request)
            search.first_request.cache_pins = checked.cache_pins
            parent = BeamSearchParent(request_id, checked.text, checked.token_ids, search, self.tokenizer)
            return NewRequest(parent, search.first_request, [])
        return self._sampled_request(request_id, checked, params, arrival_time, priority, lora_request)

    def _sampled_request(self, request_id: str, checked: CheckedPrompt, params: SamplingParams, arrival_time: float,
                         priority: int, lora_request: LoRARequest | None) -> NewRequest:
        """n (or best_of) child requests sharing one prefill: the first runs it, the others are forked from it
        when it samples, taking their first tokens from the same logits."""
        prompt_ids = checked.token_ids
        if params.bad_words:   # the caller's params stay as they are: each request gets its own copy
            sequences = [*(params.bad_words_token_ids or ()), *bad_words_token_ids(self.tokenizer, params.bad_words)]
            params = dataclasses.replace(params, bad_words_token_ids=sequences)
        num_children = params.best_of or params.n
        children = []
        for index in range(num_children):
            child_params = params.for_child(index) if num_children > 1 else params
            child_id = request_id if num_children == 1 else f"{index}_{request_id}"
            request = Request(child_id, prompt_ids, child_params, self.model_config.eos_token_ids,
                              checked.max_tokens, arrival_time=arrival_time, priority=priority,
                              cache_salt=checked.cache_salt, cache_pins=checked.cache_pins, lora_request=lora_request)
            if params.structured_outputs is not None:
                request.grammar = self.structured_output.request_grammar(params.structured_outputs)
            children.append(ChildState(request, index,
                                       IncrementalDetokenizer(self.tokenizer, prompt_ids, child_params)))
        parent = ParentRequest(request_id, checked.text, prompt_ids, params, children)
        return NewRequest(parent, children[0].request, [child.request for child in children[1:]])

    def _pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams, arrival_time: float,
                         priority: int) -> NewRequest:
        token_ids, model_token_ids = self.check_pooling_prompt(prompt, params)
        request = Request(request_id, model_token_ids, SamplingParams(), (), max_tokens=1, arrival_time=arrival_time,
                          priority=priority)
        return NewRequest(PoolingParent(request, token_ids, params, self.pooling), request, [])

    def check_pooling_prompt(self, prompt: PromptType, params: PoolingParams) -> tuple[list[int], list[int]]:
        """A pooling request's token ids, and the ids the model reads (an encoder's carry their token types);
        ValueError naming what cannot run."""
        check_pooling_params(params, self.pooling)
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict):
            cache_salt_of(prompt)
            if prompt.get("cache_pins"):
                raise ValueError("cache_pins apply to generation: a pooling prompt is computed whole and never "
                                 "reuses cached blocks")
            prompt = {key: value for key, value in prompt.items()
                      if key not in ("token_type_ids", "cache_salt", "cache_pins")}
        token_ids = self._tokenize(prompt)[1]
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}")
        if not self.kv_manager.can_ever_fit(len(token_ids)):
            raise ValueError(f"the prompt's {len(token_ids)} tokens need more KV blocks than the whole cache has "
                             f"({self.kv_manager.pool.num_blocks} blocks of {self.kv_manager.block_size}); raise "
                             "kv_cache_memory")
        if token_type_ids is None:
            return token_ids, token_ids
        return token_ids, with_token_types(token_ids, check_token_type_ids(token_type_ids, len(token_ids),
                                                                             self.pooling))

    def check_prompt(self, prompt: PromptType, params: SamplingParams | BeamSearchParams) -> CheckedPrompt:
        """Tokenizes and validates a prompt; raises ValueError naming what cannot run."""
        if self.pooling is not None:
            raise ValueError("this is a pooling model: it embeds or scores (LLM.embed / LLM.score, /v1/embeddings, "
                             "/v1/score, /v1/rerank) and cannot generate text")
        cache_salt = cache_salt_of(prompt)
        text, prompt_ids = self._tokenize(prompt)
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}: no room to generate")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = "
                             f"{len(prompt_ids) + max_tokens} exceeds max_model_len ({self.max_model_len})")
        total = len(prompt_ids) + max_tokens
        if not self.kv_manager.can_ever_fit(total):
            raise ValueError(f"prompt + max_tokens = {total} tokens need more KV blocks than the whole "
                             f"cache has ({self.kv_manager.pool.num_blocks} blocks of "
                             f"{self.kv_manager.block_size}); raise kv_cache_memory")
        if isinstance(params, SamplingParams):
            self._check_token_ids(params)
        cache_salt = prefix_cache_salt(cache_salt, self.model_config, len(prompt_ids), self.max_model_len)
        cache_pins = cache_pins_of(prompt, len(prompt_ids), self.kv_manager.enable_prefix_caching)
        return CheckedPrompt(text, prompt_ids, max_tokens, cache_salt, cache_pins)

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids the params name must be in the vocabulary."""
        vocab = self.model_config.vocab_size
        bad_word_ids = [token_id for word in params.bad_words_token_ids or () for token_id in word]
        for name, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                                ("allowed_token_ids", params.allowed_token_ids or ()),
                                ("bad_words_token_ids", bad_word_ids)):
            outside = [token_id for token_id in token_ids if token_id >= vocab]
            if outside:
                raise ValueError(f"{name} must name token ids below the vocabulary size {vocab}, got {outside[:10]}")

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
