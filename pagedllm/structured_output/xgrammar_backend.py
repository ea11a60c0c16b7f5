"""The xgrammar side: specs parsed into grammars, grammars compiled against the model's vocabulary,
matchers made from compiled grammars."""
from __future__ import annotations

import json

import xgrammar as xgr

from pagedllm.tokenizer import Tokenizer

# Compact JSON (", " and ": " between items, no other whitespace): a small model given "any whitespace"
# can fill max_tokens with newlines and never close the object.
_JSON_OPTIONS = dict(any_whitespace=False)


def parse_grammar(kind: str, text: str) -> xgr.Grammar:
    """The grammar of a spec (StructuredOutputsParams.key); ValueError naming the spec when it is invalid."""
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(text, **_JSON_OPTIONS)
        if kind == "json_object":
            # Not strict: a bare {"type": "object"} would otherwise allow only {}.
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **_JSON_OPTIONS)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            # JSON string literals are valid EBNF literals (the same escapes).
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
        return xgr.Grammar.from_ebnf(text)
    except RuntimeError as exc:   # xgrammar's parse errors: "[time] file.cc:line: message"
        reason = str(exc).strip().split(": ", 1)[-1]
        what = {"json": "a valid JSON schema", "regex": "a valid regular expression",
                "grammar": "a valid EBNF grammar", "choice": "a valid choice list",
                "json_object": "valid"}[kind]
        raise ValueError(f"structured_outputs {kind} is not {what}: {reason}") from exc


class XgrammarCompiler:
    """Compiles grammars against one tokenizer's vocabulary; thread-safe (xgrammar releases the GIL)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        # vocab_size is the model's (its logits' width), which may exceed the tokenizer's token count.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        # Our own cache keys the specs; xgrammar's would hold a second copy of each compiled grammar.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(parse_grammar(kind, text))


def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    """A matcher at the grammar's start. Its bitmask allows a stop token only where the grammar may end."""
    return xgr.GrammarMatcher(compiled)
