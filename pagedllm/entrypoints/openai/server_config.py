"""The HTTP server's own settings (the engine's are in EngineConfig), with vLLM's flag names."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.auth import load_api_keys_file
from pagedllm.entrypoints.openai.lora_modules import LoRAModulePath, lora_module

# The parsers' names (pagedllm/entrypoints/openai/tool_parsers, reasoning), listed here so reading the
# settings loads no parser code.
TOOL_PARSER_NAMES = ("hermes", "llama3_json")
REASONING_PARSER_NAMES = ("qwen3",)
# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, read as vLLM reads it.
RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_from_env() -> bool:
    return os.environ.get(RUNTIME_LORA_UPDATING_ENV, "0").strip().lower() in ("1", "true")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] | None = None   # None: the model argument, or the bundled model's name
    api_key: str | None = field(default=None, repr=False)   # a secret: kept out of logged reprs
    api_keys_file: str | None = None              # YAML {key: tenant}; each tenant's prefix cache is its own
    max_request_body_bytes: int = 4 * 2**20
    shutdown_timeout: float = 10.0                # seconds in-flight requests get to finish on SIGTERM
    max_waiting_requests: int | None = None       # past it new requests get 503 + Retry-After; None: no bound
    disable_dashboard: bool = False               # drop /dashboard and /v1/kv_map*
    chat_template: str | None = None              # a Jinja file used instead of the model's own template
    tool_call_parser: str | None = None           # hermes or llama3_json: how "auto" tool calls are read
    enable_auto_tool_choice: bool = False         # allow tool_choice "auto" (needs tool_call_parser)
    reasoning_parser: str | None = None           # qwen3: <think>...</think> becomes reasoning_content
    responses_store_size: int = 1000              # stored responses (store: true) kept; the oldest go first
    responses_store_ttl: float = 3600.0           # seconds a stored response is kept
    lora_modules: list[LoRAModulePath] | None = None   # adapters served from start-up (needs enable_lora)
    allow_runtime_lora_updating: bool = False     # serve /v1/load_lora_adapter and /v1/unload_lora_adapter
    tenant_keys: dict[str, str] = field(init=False, repr=False, default_factory=dict)   # read from api_keys_file
    chat_template_text: str | None = field(init=False, repr=False, default=None)   # read from chat_template

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not (
                self.served_model_name and all(isinstance(n, str) and n for n in self.served_model_name)):
            raise ValueError(f"served_model_name must be one or more non-empty names, "
                             f"got {self.served_model_name!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string")
        if self.api_keys_file is not None and (not isinstance(self.api_keys_file, str) or not self.api_keys_file):
            raise ValueError(f"api_keys_file must be a path, got {self.api_keys_file!r}")
        if self.api_keys_file is not None:   # read now, so a bad file stops the server before the model loads
            self.tenant_keys = load_api_keys_file(self.api_keys_file)
        if self.max_waiting_requests is not None and (
                isinstance(self.max_waiting_requests, bool) or not isinstance(self.max_waiting_requests, int)
                or self.max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests must be an integer >= 1, got {self.max_waiting_requests!r}")
        if (isinstance(self.max_request_body_bytes, bool) or not isinstance(self.max_request_body_bytes, int)
                or self.max_request_body_bytes < 1):
            raise ValueError(f"max_request_body_bytes must be an integer >= 1, got {self.max_request_body_bytes!r}")
        if isinstance(self.shutdown_timeout, bool) or not isinstance(self.shutdown_timeout, (int, float)) \
                or self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be a number of seconds >= 0, got {self.shutdown_timeout!r}")
        if isinstance(self.responses_store_size, bool) or not isinstance(self.responses_store_size, int) \
                or self.responses_store_size < 1:
            raise ValueError(f"responses_store_size must be an integer >= 1, got {self.responses_store_size!r}")
        if isinstance(self.responses_store_ttl, bool) or not isinstance(self.responses_store_ttl, (int, float)) \
                or self.responses_store_ttl <= 0:
            raise ValueError(f"responses_store_ttl must be a number of seconds > 0, got {self.responses_store_ttl!r}")
        self._check_chat_settings()
        self._check_lora_settings()

    def _check_lora_settings(self) -> None:
        if self.lora_modules is not None:
            if not isinstance(self.lora_modules, list):
                raise ValueError(f"lora_modules must be a list of name=path entries, got {self.lora_modules!r}")
            self.lora_modules = [lora_module(value) for value in self.lora_modules]
            names = [module.name for module in self.lora_modules]
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise ValueError(f"lora_modules: each adapter needs its own name; {', '.join(repeated)} is given twice")
        if not isinstance(self.allow_runtime_lora_updating, bool):
            raise ValueError(f"allow_runtime_lora_updating must be True or False, "
                             f"got {self.allow_runtime_lora_updating!r}")
        self.allow_runtime_lora_updating = self.allow_runtime_lora_updating or runtime_lora_updating_from_env()

    def check_engine(self, engine: EngineConfig) -> None:
        """Server settings that need the engine's: adapters need enable_lora."""
        if not engine.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules needs enable_lora (--enable-lora): the engine runs no adapters "
                                 "without it")
            if self.allow_runtime_lora_updating:
                raise ValueError(f"allow_runtime_lora_updating (--allow-runtime-lora-updating or "
                                 f"{RUNTIME_LORA_UPDATING_ENV}) needs enable_lora (--enable-lora)")

    def _check_chat_settings(self) -> None:
        for name, allowed in (("tool_call_parser", TOOL_PARSER_NAMES), ("reasoning_parser", REASONING_PARSER_NAMES)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes or llama3_json)")
        if self.chat_template is not None:   # read now, so a missing file stops the server before the model loads
            try:
                self.chat_template_text = Path(self.chat_template).read_text()
            except OSError as exc:
                raise ValueError(f"chat_template {self.chat_template!r} cannot be read: {exc}") from exc

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.init}
