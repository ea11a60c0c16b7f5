"""One request's grammar state: its compile (shared, maybe still running) and its own matcher.

The API is token lists, not single tokens, so a verifier of several proposed tokens per step
(speculative decoding) can accept them, fill a row's bitmask and roll back the rejected ones.
"""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch
import xgrammar as xgr

from pagedllm.structured_output.xgrammar_backend import new_matcher


class RequestGrammar:
    def __init__(self, compiled: Future):
        self.compiled = compiled   # the CompiledGrammar, shared by every request with the same spec
        self._matcher: xgr.GrammarMatcher | None = None

    @property
    def is_ready(self) -> bool:
        """Compiled (or failed to compile: `error` says why); until then the request waits to be admitted."""
        return self.compiled.done()

    @property
    def error(self) -> str | None:
        if not self.compiled.done() or self.compiled.exception() is None:
            return None
        exc = self.compiled.exception()
        return f"the grammar failed to compile: {type(exc).__name__}: {exc}"

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = new_matcher(self.compiled.result())
        return self._matcher

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Advances over the tokens in order; returns how many it accepted (it stops at the first refused)."""
        matcher = self.matcher
        for count, token_id in enumerate(token_ids):
            if not matcher.accept_token(token_id):
                return count
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepted tokens."""
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (int32 words, bit i of word j is token 32j+i)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        return self.matcher.is_terminated()


def allocate_bitmask(num_rows: int, num_words: int) -> tuple[np.ndarray, torch.Tensor]:
    """A bitmask as a numpy array (plain step data, picklable) and a torch view of the same memory
    (what xgrammar fills)."""
    array = np.full((num_rows, num_words), -1, np.int32)
    return array, torch.from_numpy(array)
