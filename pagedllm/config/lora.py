"""LoRA serving limits in vLLM's names: how many adapters, how large, how many kept in memory."""
from __future__ import annotations

from dataclasses import dataclass

# vLLM's allowed --max-lora-rank values; adapters of any rank up to the limit load.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")   # auto: the model's dtype


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1                # adapters resident in one step (slots of the stacked A/B weights)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded (LRU) beyond the resident ones; None: max_loras
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {self.max_loras!r}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, "
                             f"got {self.max_lora_rank!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif (isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int)
              or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
