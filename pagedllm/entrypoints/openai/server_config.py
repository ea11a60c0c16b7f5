"""The HTTP server's own settings (the engine's are in EngineConfig), with vLLM's flag names."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] | None = None   # None: the model argument, or the bundled model's name
    api_key: str | None = field(default=None, repr=False)   # a secret: kept out of logged reprs
    max_request_body_bytes: int = 4 * 2**20
    shutdown_timeout: float = 10.0                # seconds in-flight requests get to finish on SIGTERM

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
        if (isinstance(self.max_request_body_bytes, bool) or not isinstance(self.max_request_body_bytes, int)
                or self.max_request_body_bytes < 1):
            raise ValueError(f"max_request_body_bytes must be an integer >= 1, got {self.max_request_body_bytes!r}")
        if isinstance(self.shutdown_timeout, bool) or not isinstance(self.shutdown_timeout, (int, float)) \
                or self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be a number of seconds >= 0, got {self.shutdown_timeout!r}")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
