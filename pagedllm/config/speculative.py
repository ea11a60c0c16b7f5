"""`speculative_config` in vLLM's shape: `{"method": "ngram", "num_speculative_tokens": 4, ...}`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
QUANTIZATIONS = ("auto", "none", "int8", "int4")   # the draft's, as EngineConfig.quantization
# disable_by_batch_size when unset: the largest batch where speculation was measured not to lose, idle, on the
# default engine and in float32 (docs/speculative-decoding.md, issue 27). ngram lost from 8 running requests in
# float32 (-19% on random prompts); a draft model from 4 (its k passes are not batched away).
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 4, "draft_model": 2}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None   # ngram: longest suffix looked up (default 4)
    prompt_lookup_min: int | None = None   # ngram: shortest suffix that counts as a match (default 2)
    model: str | None = None               # draft_model: the draft's folder, GGUF file or cached name
    quantization: str = "auto"             # draft_model: how the draft's weights run
    # No speculation in a step that starts with more running requests than this: verifying k extra rows
    # stops paying once the batch already keeps the CPU's arithmetic busy (bench latency measures where).
    # "auto": DEFAULT_DISABLE_BY_BATCH_SIZE for the method; None (JSON null): speculate at every batch size.
    disable_by_batch_size: int | str | None = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model is for method 'draft_model'; ngram proposes from the "
                                 f"request's own tokens, got model {self.model!r}")
            maximum = self.prompt_lookup_max if self.prompt_lookup_max is not None else 4
            minimum = self.prompt_lookup_min if self.prompt_lookup_min is not None else min(2, maximum)
            _check_int("prompt_lookup_max", maximum, 1)
            _check_int("prompt_lookup_min", minimum, 1)
            if minimum > maximum:
                raise ValueError(f"speculative_config.prompt_lookup_min ({minimum}) must be <= prompt_lookup_max "
                                 f"({maximum})")
            object.__setattr__(self, "prompt_lookup_max", maximum)
            object.__setattr__(self, "prompt_lookup_min", minimum)
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model must name the draft model (a folder, GGUF file or "
                                 f"cached name) for method 'draft_model', got {self.model!r}")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram', not 'draft_model'")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config.quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.disable_by_batch_size == "auto":
            object.__setattr__(self, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE[self.method])
        elif self.disable_by_batch_size is not None:
            value = self.disable_by_batch_size
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError('speculative_config.disable_by_batch_size must be an integer >= 1, "auto" or null '
                                 f"(speculate at every batch size), got {value!r}")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict) -> SpeculativeConfig:
        """From a dict (LLM argument, parsed --speculative-config JSON, YAML mapping); unknown keys are errors."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping such as {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 4}}, got {type(value).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(sorted(map(str, unknown)))}; "
                             f"known keys: {', '.join(sorted(known))}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config needs {required!r}")
        return cls(**value)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"speculative_config.{name} must be an integer >= {minimum}, got {value!r}")
