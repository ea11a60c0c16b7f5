"""Every failure leaves the server as OpenAI's error body, {"error": {"message", "type", "param", "code"}},
or on Anthropic's routes (/v1/messages...) as Anthropic's, {"type": "error", "error": {"type", "message"}}."""
from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedllm.engine.protocol import EngineDeadError, EngineOverloadedError, EngineRequestError
from pagedllm.sampling_params import SamplingParams

# OpenAI's error types by status; the rest are server errors.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                503: "service_unavailable_error"}


# Anthropic's error types by status; the rest are api_error.
_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                          429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATH_PREFIX = "/v1/messages"

RETRY_AFTER_SECONDS = 1   # told to clients refused because too many requests wait


class APIError(Exception):
    """An error to send to the client as it is: status, message and the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def sampling_field_named_in(message: str) -> str | None:
    """The SamplingParams field a validation message is about: they start with its name
    ("temperature must be >= 0, got -1"), as do the engine's checks of them."""
    field = message.split(" ", 1)[0]
    return field if field in SamplingParams.__dataclass_fields__ else None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None, path: str = "") -> dict:
    """The error in the shape of the API the request came to (path); Anthropic's has no param field,
    so its message names the field."""
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        if param is not None and param not in message:
            message = f"{param}: {message}"
        return {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                           "message": message}}
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, path), status_code=status, headers=headers)


def api_error_for(exc: Exception) -> APIError:
    """What a failure inside generation means for the client (used mid-stream, too)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the server is shutting down", code="engine_shut_down")
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, f"the server is overloaded: {exc}", code="server_overloaded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineRequestError):
        return APIError(500, str(exc), code="engine_error")
    return APIError(500, f"internal error: {type(exc).__name__}")


def validation_error_response(exc: RequestValidationError, path: str = "") -> JSONResponse:
    """FastAPI's 422 as OpenAI's 400, naming the field ("messages.0.role"). A value that fits no
    member of a union fails once per member, so param is the path all the errors share."""
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":
        reason = errors[0].get("ctx", {}).get("error", "")
        return error_response(400, f"the request body is not valid JSON: {reason}".rstrip(": "), path=path)
    paths = [[str(part) for part in error["loc"][1:]] for error in errors]
    shared = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        shared.append(parts[0])
    details = "; ".join(f"{'.'.join(path) or 'body'}: {error['msg']}" for path, error in zip(paths, errors))
    return error_response(400, details, param=".".join(shared) or None, path=path)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc, request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message, headers=exc.headers, path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        error = api_error_for(exc)
        return error_response(error.status, error.message, error.param, error.code, error.headers, request.url.path)
