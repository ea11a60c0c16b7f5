"""Compiles each distinct spec once, on a thread pool off the engine thread, and fills the step's bitmask.

The scheduler holds the manager: it gives each new request a RequestGrammar, admits a request only
once its grammar is compiled (others run meanwhile), and asks for the bitmask of the rows that sample
in a step. Rows without a grammar are not in the bitmask at all.
"""
from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np

from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.request_grammar import RequestGrammar, allocate_bitmask
from pagedllm.structured_output.xgrammar_backend import XgrammarCompiler
from pagedllm.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 512   # compiled JSON-schema grammars are tens of kB to a few MB each


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_workers: int = 2):
        self._tokenizer, self._vocab_size, self._stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self._compiler: XgrammarCompiler | None = None   # built on first use: tokenizer info costs ~0.5 s
        self._compiler_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="pagedllm-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()   # least recently used first
        self.num_compiles = 0

    @property
    def compiler(self) -> XgrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = XgrammarCompiler(self._tokenizer, self._vocab_size, self._stop_token_ids)
            return self._compiler

    @property
    def bitmask_words(self) -> int:
        return -(-self._vocab_size // 32)

    def request_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A new matcher state for a request; the spec compiles at most once while it stays cached."""
        compiled = self._cache.get(params.key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._pool.submit(self._compile, params.key)
            self._cache[params.key] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(params.key)
        return RequestGrammar(compiled)

    def _compile(self, key: tuple[str, str]):
        self.num_compiles += 1
        return self.compiler.compile(*key)

    def wait_for_compiles(self, grammars: list[RequestGrammar], timeout: float) -> None:
        """Blocks until one of these grammars is compiled, or timeout seconds: what an engine with nothing
        else to run does instead of spinning."""
        pending = [grammar.compiled for grammar in grammars if not grammar.is_ready]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def grammar_bitmask(self, grammars: list[RequestGrammar]) -> np.ndarray:
        """[len(grammars), words] int32: row i allows what grammars[i] allows next."""
        array, view = allocate_bitmask(len(grammars), self.bitmask_words)
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(view, row)
        return array

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
