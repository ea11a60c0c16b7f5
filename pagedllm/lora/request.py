"""Which adapter a request runs with (vLLM's `LoRARequest`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and PEFT folder (`adapter_config.json` + `adapter_model.safetensors`).

    lora_int_id is the adapter's identity everywhere below the API (slots, the prefix-cache key); 0 is the
    base model, so ids start at 1.
    """
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a path string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


class LoRAInUseError(RuntimeError):
    """Removing an adapter that unfinished requests still run with (the server answers 409)."""
