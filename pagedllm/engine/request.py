"""A request's state as the scheduler and engine see it (no tensors)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(frozen=True)
class CachePin:
    """Keep the KV of the prompt's first num_tokens tokens (its full blocks) cached for ttl_s seconds
    after the prefill computes them (Anthropic's cache_control, the `cache_pins` prompt key)."""
    num_tokens: int
    ttl_s: float


@dataclass(eq=False)
class Request:
    """One sequence to generate.

    `all_token_ids` is the single record of the sequence (prompt then output);
    `num_computed_tokens` says how many of them already have KV in the cache.
    """
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None   # enters the first KV block's hash: only equal salts share cached blocks
    cache_pins: tuple[CachePin, ...] = ()   # prefixes pinned in the prefix cache once the prompt is computed
    lora_request: LoRARequest | None = None   # the adapter it runs with; None: the base model
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0   # of those, found in the prefix cache when it was last admitted (vLLM's name)
    num_pinned_tokens: int = 0   # prompt tokens its cache_pins hold (the longest), once its prompt is computed
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    error: str | None = None
    beam_search: object | None = None   # the BeamSearch this beam belongs to; it chooses the beam's tokens
    grammar: object | None = None   # its structured output's RequestGrammar; dropped when it finishes
    # What the workers' batch holds of this request, so that a step sends only what changed;
    # 0 tokens: not in the batch (not yet scheduled, or preempted since).
    worker_num_tokens: int = 0
    worker_num_blocks: int = 0
    all_token_ids: list[int] = field(init=False)
    # A sampled token can stop the request only if it is one of these ids or brings it to this length
    # (or it has a grammar): the scheduler runs the full check_stop for those tokens only.
    stop_check_ids: frozenset[int] = field(init=False)
    stop_check_length: int = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.stop_check_ids = frozenset((*self.eos_token_ids, *self.sampling_params.stop_token_ids))
        self.stop_check_length = len(self.prompt_token_ids) + self.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
