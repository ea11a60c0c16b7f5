"""Structured outputs: a request's output constrained by a JSON schema, regex, choice list or EBNF grammar.

`params` says what a request asks for (no torch); `xgrammar_backend` parses and compiles it with
xgrammar; `manager` compiles each spec once, on a thread pool, and fills the step's token bitmask;
`request_grammar` is one request's matcher state. The scheduler advances the matchers, the runner
applies the bitmask to the logits (`pagedllm.worker.token_bitmask`).
"""
from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
