"""`--lora-modules` values in vLLM's two forms, `name=path` and `{"name": ..., "path": ..., "base_model_name": ...}`."""
from __future__ import annotations

import json
from dataclasses import dataclass

_JSON_KEYS = ("name", "path", "base_model_name")


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter served from start-up: the model name requests give, and its PEFT folder."""
    name: str
    path: str
    base_model_name: str | None = None   # the base it is listed under (its `parent`); None: the first served name

    def __post_init__(self) -> None:
        for field_name in ("name", "path"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"lora_modules: {field_name} must be a non-empty string, got {value!r}")
        if self.base_model_name is not None and (not isinstance(self.base_model_name, str)
                                                 or not self.base_model_name):
            raise ValueError(f"lora_modules: base_model_name must be a non-empty string, "
                             f"got {self.base_model_name!r}")


def lora_module(value: str | dict | LoRAModulePath) -> LoRAModulePath:
    """One --lora-modules value (a flag's text, or a YAML entry: text or mapping) as a LoRAModulePath."""
    if isinstance(value, LoRAModulePath):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_modules: {value!r} is not valid JSON: {exc}") from None
    if isinstance(value, dict):
        unknown = value.keys() - set(_JSON_KEYS)
        if unknown:
            raise ValueError(f"lora_modules: unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                             f"allowed: {', '.join(_JSON_KEYS)}")
        if "name" not in value or "path" not in value:
            raise ValueError(f"lora_modules: a JSON entry needs name and path, got {value!r}")
        return LoRAModulePath(value["name"], value["path"], value.get("base_model_name"))
    if isinstance(value, str) and "=" in value:
        name, path = value.split("=", 1)
        return LoRAModulePath(name.strip(), path.strip())
    raise ValueError(f"lora_modules: expected name=path or a JSON object with name and path, got {value!r}")
