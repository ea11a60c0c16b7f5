"""How to pick tokens and when to stop, with vLLM's names, defaults and checks."""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from pagedllm.structured_output.params import StructuredOutputsParams

# vLLM treats temperatures below this as greedy: dividing by them would overflow.
_SAMPLING_EPS = 1e-5
# Like vLLM's default max_logprobs: top logprobs cost a topk over the vocabulary per row.
MAX_LOGPROBS = 20
# As OpenAI's API: each sample is a sequence of its own, so an unbounded n could hold the engine for hours.
MAX_SAMPLES = 128
# Values the sampler puts in int64 tensors or hands to torch.Generator.manual_seed.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# OpenAI's range for logit_bias values: -100 bans a token, +100 all but forces it.
MAX_LOGIT_BIAS = 100.0


def _check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> None:
    # bool is an int subclass, but n=True is always a caller's mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_shown(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {_allowed_range(minimum, maximum)}, got {_shown(value)}")


def _allowed_range(minimum: int | None, maximum: int | None) -> str:
    if maximum is None:
        return f">= {minimum}"
    if minimum is None:
        return f"<= {maximum}"
    return f"in [{minimum}, {maximum}]"


def _to_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:   # an int beyond the float range, such as 10**400
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {_shown(value)}")
    return number


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {_shown(value)}")


def _shown(value) -> str:
    """The value for an error message, cut short: a client's 4 MB stop list need not come back in its error."""
    try:
        text = repr(value)
    except ValueError:   # an int past Python's 4300-digit limit on int-to-text conversion
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""
    CUMULATIVE = 0   # everything so far
    DELTA = 1        # only what is new since the last output (streaming)
    FINAL_ONLY = 2   # nothing until the request finishes


@dataclass
class SamplingParams:
    """Per-request generation settings; invalid values fail here, at the API edge, not mid-batch."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logit controls (OpenAI's logit_bias, vLLM's allowed_token_ids and bad_words).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None   # the output must match this grammar
    # bad_words as token-id sequences: set by the engine, which holds the tokenizer (vLLM keeps it private).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self._normalise_and_check_sampling()
        self._normalise_and_check_logit_controls()
        self._normalise_and_check_stopping()
        self._check_outputs()

    def _normalise_and_check_sampling(self) -> None:
        _check_int("n", self.n, minimum=1, maximum=MAX_SAMPLES)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, maximum=MAX_SAMPLES)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _to_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _to_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.temperature = _to_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _to_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, maximum=INT64_MAX)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        self.min_p = _to_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=INT64_MIN, maximum=INT64_MAX)
        if self.is_greedy:
            # As vLLM: truncation cannot change an argmax, and best_of greedy copies would tie.
            # n > 1 stays allowed, as in OpenAI's API: the n answers are simply identical.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if (self.best_of or 1) > 1:
                raise ValueError(
                    f"best_of must be 1 when temperature is 0 (greedy sampling), got {self.best_of}")

    def _normalise_and_check_logit_controls(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_shown(self.logit_bias)}")
            bias = {}
            for token_id, value in self.logit_bias.items():
                _check_int("logit_bias", token_id, minimum=0)
                value = _to_float("logit_bias", value)
                if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                     f"got {value:g} for token {token_id}")
                bias[token_id] = value
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {_shown(self.allowed_token_ids)}")
            self.allowed_token_ids = list(self.allowed_token_ids)
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id, minimum=0)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {_shown(self.bad_words)}")
            self.bad_words = list(self.bad_words)
            for index, word in enumerate(self.bad_words):
                if not (isinstance(word, str) and word.strip()):
                    raise ValueError(f"bad_words must hold only non-blank strings, got {_shown(word)} at index {index}")
            self.bad_words = self.bad_words or None
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, (list, tuple)) or not all(
                    isinstance(word, (list, tuple)) and word for word in self.bad_words_token_ids):
                raise ValueError(f"bad_words_token_ids must be a list of non-empty token-id lists, "
                                 f"got {_shown(self.bad_words_token_ids)}")
            self.bad_words_token_ids = [list(word) for word in self.bad_words_token_ids]
            for token_id in (token_id for word in self.bad_words_token_ids for token_id in word):
                _check_int("bad_words_token_ids", token_id, minimum=0)

    @property
    def has_logit_controls(self) -> bool:
        """Whether the sampler must change this row's logits for logit_bias, allowed_token_ids or bad_words."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def _normalise_and_check_stopping(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {_shown(self.stop)}")
        for index, stop in enumerate(self.stop):
            if not (isinstance(stop, str) and stop):
                raise ValueError(f"stop must hold only non-empty strings, got {_shown(stop)} at index {index}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of token ids, got {_shown(self.stop_token_ids)}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {_shown(self.min_tokens)}")

    def _check_outputs(self) -> None:
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be in [0, {MAX_LOGPROBS}] (at most {MAX_LOGPROBS} top "
                    f"logprobs per token are supported), got {_shown(self.logprobs)}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, maximum=MAX_LOGPROBS)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("spaces_between_special_tokens", self.spaces_between_special_tokens)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {_shown(self.structured_outputs)}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {_shown(self.output_kind)}")
        if self.output_kind is RequestOutputKind.DELTA and (self.best_of or self.n) > self.n:
            raise ValueError("best_of must equal n when streaming: the best samples are only known at the end")

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax instead of drawing."""
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> SamplingParams:
        """An independent copy (its stop lists are new lists)."""
        return dataclasses.replace(self)

    def for_child(self, index: int) -> SamplingParams:
        """Params for the index-th of n parallel samples: one sequence each, seeds kept distinct as vLLM does."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, best_of=None, seed=seed)
