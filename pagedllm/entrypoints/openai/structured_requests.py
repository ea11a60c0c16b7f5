"""The request fields that ask for structured output, in OpenAI's and vLLM's spellings, turned into one
StructuredOutputsParams; a bad or conflicting one is a 400 naming the field the client used."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.structured_output.params import StructuredOutputsParams


class StrictModel(BaseModel):
    """Nested request objects: strict types, and a misspelt key is a 400, not silently dropped."""
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class JsonSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")   # `schema` would shadow a BaseModel method
    strict: bool | None = None   # the grammar always enforces the schema exactly


class ResponseFormat(StrictModel):
    """OpenAI's response_format."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(StrictModel):
    """vLLM's structured_outputs object."""
    json_: dict[str, Any] | str | None = Field(alias="json", default=None)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputFields(BaseModel):
    """Mixed into the completions and chat requests."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def requested_structured_outputs(self) -> tuple[str, dict[str, Any]] | None:
        """(request field, StructuredOutputsParams arguments) of the one field set; None if none is."""
        given: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append(("response_format", _response_format_spec(self.response_format)))
        if self.structured_outputs is not None:
            spec = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            given.append(("structured_outputs", spec))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        if len(given) > 1:
            raise APIError(400, f"only one of response_format, structured_outputs and guided_* may constrain the "
                                f"output, got {', '.join(name for name, _ in given)}", param=given[1][0])
        return given[0] if given else None


def _response_format_spec(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.json_schema is None:
        raise APIError(400, "response_format json_schema needs a json_schema object ({name, schema, strict})",
                       param="response_format")
    return {"json": response_format.json_schema.json_schema}


def structured_outputs_params(field: str, spec: dict[str, Any]) -> StructuredOutputsParams:
    """StructuredOutputsParams of a request field; its ValueError (the invalid schema or grammar) is a 400."""
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from exc
