"""API-key check (`--api-key`): every request but /health must carry `Authorization: Bearer <key>`.

A pure ASGI middleware, so a request without the key is refused before its body is read.
"""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import error_response

OPEN_PATHS = frozenset({"/health"})   # load balancers probe it without credentials
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        if given is None:
            response = error_response(401, "missing API key: send it as 'Authorization: Bearer <key>'",
                                      code="missing_api_key", headers=_CHALLENGE)
        elif not self._matches(given):
            response = error_response(401, "invalid API key: send it as 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", headers=_CHALLENGE)
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)

    def _matches(self, authorization: bytes) -> bool:
        """The scheme is case-insensitive (RFC 7235, so "bearer" is fine); the key is compared in
        constant time, so its bytes cannot be guessed one by one from response times."""
        scheme, _, token = authorization.partition(b" ")
        key_matches = hmac.compare_digest(token, self.expected)
        return scheme.lower() == b"bearer" and key_matches
