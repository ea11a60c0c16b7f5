"""API-key check (`--api-key`, `--api-keys-file`): every request but /health must carry
`Authorization: Bearer <key>` (or, as Anthropic's clients send it, `x-api-key: <key>`).

A pure ASGI middleware, so a request without the key is refused before its body is read.
Each key may name a tenant; the handlers find it in `request.state.tenant` (None for a key
without one) and salt the tenant's prefix-cache blocks with it.
"""
from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path

import yaml
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import error_response

# Load balancers probe /health without credentials; the dashboard's shell holds no data and a browser
# cannot send a key with a navigation (the page asks for the key and sends it with each data request).
OPEN_PATHS = frozenset({"/health", "/dashboard"})
_CHALLENGE = {"WWW-Authenticate": "Bearer"}
_HOW_TO_SEND = "send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"


def load_api_keys_file(path: str | Path) -> dict[str, str]:
    """{key: tenant} from a YAML mapping; raises ValueError naming what is wrong (never the keys)."""
    try:
        with open(path, encoding="utf-8") as file:
            document = yaml.safe_load(file)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"api_keys_file {path}: cannot be read as YAML: {type(exc).__name__}") from exc
    if not isinstance(document, dict) or not document:
        raise ValueError(f"api_keys_file {path}: must be a non-empty mapping of API key to tenant name")
    for number, (key, tenant) in enumerate(document.items(), start=1):
        if not (isinstance(key, str) and key and isinstance(tenant, str) and tenant):
            raise ValueError(f"api_keys_file {path}: entry {number} must map a non-empty string key to a "
                             "non-empty string tenant name")
    return document


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: Mapping[str, str | None]):
        """keys: every accepted API key and the tenant it belongs to (None: no tenant)."""
        if not keys:
            raise ValueError("APIKeyMiddleware needs at least one key")
        self.app = app
        self.keys = [(key.encode(), tenant) for key, tenant in keys.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization")
        if given is None and b"x-api-key" in headers:   # Anthropic's clients send the key so
            given = b"Bearer " + headers[b"x-api-key"]
        path = scope["path"]
        if given is None:
            response = error_response(401, f"missing API key: {_HOW_TO_SEND}", code="missing_api_key",
                                      headers=_CHALLENGE, path=path)
        else:
            matched, tenant = self._match(given)
            if matched:
                scope.setdefault("state", {})["tenant"] = tenant
                await self.app(scope, receive, send)
                return
            response = error_response(401, f"invalid API key: {_HOW_TO_SEND}", code="invalid_api_key",
                                      headers=_CHALLENGE, path=path)
        await response(scope, receive, send)

    def _match(self, authorization: bytes) -> tuple[bool, str | None]:
        """(whether a key matches, its tenant). The scheme is case-insensitive (RFC 7235, so "bearer" is
        fine); the token is compared with every key in constant time, never stopping at a match, so
        neither a key's bytes nor which key matched can be read from response times."""
        scheme, _, token = authorization.partition(b" ")
        matched, tenant = False, None
        for key, key_tenant in self.keys:
            if hmac.compare_digest(token, key):
                matched, tenant = True, key_tenant
        return matched and scheme.lower() == b"bearer", tenant
