"""What the APIs that translate into chat requests (Responses, Messages) share: building the chat request
from their fields, and their names for fields in the chat path's 400s."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest


def chat_request_from(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request of the fields set (None: left out); a value chat cannot take is a 400 naming it."""
    try:
        return ChatCompletionRequest.model_validate({name: value for name, value in fields.items()
                                                     if value is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(part) for part in error["loc"])
        raise APIError(400, f"{path}: {error['msg']}", param=path.split(".")[0]) from exc


def renamed(error: APIError, names: dict[str, str]) -> APIError:
    """A 400 from the chat path, naming the field as the client's API calls it (names: chat's -> its)."""
    head = (error.param or "").split(".")[0]
    name = names.get(head)
    if name is None:
        return error
    message = error.message.replace(head, name, 1) if error.message.startswith(head) else error.message
    return APIError(error.status, message, name, error.code, error.headers)
