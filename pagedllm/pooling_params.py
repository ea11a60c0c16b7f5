"""What a pooling request asks for (vLLM's PoolingParams) and how a pooling model pools (vLLM's PoolerConfig)."""
from __future__ import annotations

from dataclasses import dataclass, fields

# vLLM's PoolerConfig.pooling_type values; `--pooling` takes them in lower case too.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TASKS = ("embed", "score")


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's PoolerConfig (`--pooler-config`, formerly `--override-pooler-config`): None fields are read
    from the checkpoint (its sentence-transformers files) or take the architecture's default."""
    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)} (any case), "
                                 f"got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", self.pooling_type.upper())
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def from_value(cls, value: PoolerConfig | dict) -> PoolerConfig:
        if isinstance(value, PoolerConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a mapping such as {{\"pooling_type\": \"MEAN\"}}, got {value!r}")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config keys must be among {', '.join(sorted(known))}, got {', '.join(unknown)}")
        return cls(**value)

    def or_else(self, other: PoolerConfig) -> PoolerConfig:
        """Each field of self, or other's where self leaves it None."""
        return PoolerConfig(*(getattr(self, f.name) if getattr(self, f.name) is not None else getattr(other, f.name)
                              for f in fields(self)))


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request. task: embed (a vector) or score (a cross-encoder's relevance of a pair);
    dimensions: Matryoshka truncation of the embedding; normalize: None takes the model's pooler setting."""
    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True or False, got {self.normalize!r}")
