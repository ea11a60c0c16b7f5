"""What a request's output must match: vLLM's StructuredOutputsParams (one of json, regex, choice,
grammar, json_object), checked when it is made so a bad schema fails at the API edge."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields is set. `json` is a JSON schema (a dict or its JSON text), `regex` a
    regular expression the whole output matches, `choice` the list of allowed outputs, `grammar` an
    EBNF grammar (xgrammar's dialect, rule `root` first), `json_object` any JSON object."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The canonical (kind, text) that keys the compile cache; filled in by __post_init__.
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) is not None
                 and not (kind == "json_object" and self.json_object is False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, "
                             f"got {', '.join(given) or 'none'}")
        kind = given[0]
        try:
            text = _canonical_text(kind, getattr(self, kind))
        except RecursionError as exc:
            raise ValueError(f"structured_outputs {kind} is nested too deeply") from exc
        object.__setattr__(self, "key", (kind, text))
        # Parsing needs no tokenizer and takes well under a millisecond for usual schemas; compiling
        # against the vocabulary (the slow part) happens later, off the engine thread.
        from pagedllm.structured_output.xgrammar_backend import parse_grammar
        parse_grammar(*self.key)

    @property
    def kind(self) -> str:
        return self.key[0]


def _canonical_text(kind: str, value) -> str:
    """The spec as one string, with the type checks each kind needs."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"structured_outputs json must be a JSON schema, got text that is not "
                                 f"JSON: {exc}") from exc
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"structured_outputs json must be a JSON schema (an object), got "
                             f"{type(value).__name__}")
        return json.dumps(value)   # key order kept: the grammar writes properties in schema order
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs json_object must be true, got {value!r}")
        return ""
    if kind == "choice":
        if not (isinstance(value, (list, tuple)) and value and all(isinstance(c, str) and c for c in value)):
            raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings, "
                             f"got {value!r:.200}")
        return json.dumps(list(value))
    if not (isinstance(value, str) and value):
        raise ValueError(f"structured_outputs {kind} must be a non-empty string, got {value!r:.200}")
    return value
