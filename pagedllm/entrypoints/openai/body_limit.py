"""Refuses request bodies over a size limit with 413, without reading them whole.

A declared Content-Length over the limit is refused before any byte is read; a chunked
upload is counted as it streams in and refused the moment it passes the limit.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import error_response


class RequestSizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, scope: Scope):
        return error_response(413, f"the request body is larger than the server's limit of {self.max_bytes} bytes",
                              code="request_too_large", path=scope["path"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope)(scope, receive, send)
            return

        received = 0
        refused = False   # once set, the app is told the client left and its answer is dropped
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not response_started:
                        await self._too_large(scope)(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if not refused:   # the app's own answer to the "disconnect" must not follow the 413
                response_started = True
                await send(message)

        await self.app(scope, counting_receive, guarded_send)
