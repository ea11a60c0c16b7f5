"""logit_bias, allowed_token_ids and bad_words as a step's tensors, applied to the logits before sampling.

Each row's controls are turned into arrays once, when the row joins the batch (RowLogitControls);
a step gathers only the rows that have some, so a batch where no row uses them pays nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.token_bitmask import apply_token_bitmask, pack_allowed, stack_bitmasks


@dataclass(frozen=True)
class RowLogitControls:
    """One request's controls, in the form the step's tensors are gathered from."""
    bias_ids: np.ndarray             # int64 token ids with a logit_bias
    bias_values: np.ndarray          # float32, the biases
    allowed_bitmask: np.ndarray | None   # pack_allowed's words of allowed_token_ids; None: every token allowed
    bad_words: tuple[tuple[int, ...], ...]   # token-id sequences that may not be completed

    @classmethod
    def of(cls, params: SamplingParams) -> RowLogitControls | None:
        if not params.has_logit_controls:
            return None
        bias = params.logit_bias or {}
        allowed = params.allowed_token_ids
        return cls(bias_ids=np.fromiter(bias.keys(), np.int64, len(bias)),
                   bias_values=np.fromiter(bias.values(), np.float32, len(bias)),
                   allowed_bitmask=None if allowed is None else pack_allowed(np.array(allowed, np.int64)),
                   bad_words=tuple(tuple(word) for word in params.bad_words_token_ids or ()))

    def banned_by_bad_words(self, output_token_ids: np.ndarray) -> list[int]:
        """The tokens that would complete a bad word after these output tokens (vLLM's rule: a word of one
        token is always banned, a longer one when the output ends with all but its last token)."""
        banned = []
        for word in self.bad_words:
            prefix_length = len(word) - 1
            if prefix_length > len(output_token_ids):
                continue
            if prefix_length == 0 or tuple(output_token_ids[-prefix_length:].tolist()) == word[:-1]:
                banned.append(word[-1])
        return banned


@dataclass
class LogitControlsBatch:
    """The step's controls for the rows that have some (row indices are positions among the sampling rows)."""
    bias_rows: torch.Tensor | None = None      # with bias_ids, bias_values: (row, id, bias) triples
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    allowed_rows: torch.Tensor | None = None       # [k] int64 rows restricted to allowed_bitmask[i]
    allowed_bitmask: np.ndarray | None = None      # [k, words] int32, token_bitmask's layout
    banned_rows: torch.Tensor | None = None    # with banned_ids: (row, id) pairs bad words ban now
    banned_ids: torch.Tensor | None = None

    @classmethod
    def build(cls, controls: list[RowLogitControls | None], token_ids: np.ndarray, rows: np.ndarray,
              num_prompt_tokens: np.ndarray, num_tokens: np.ndarray, vocab_size: int, device
              ) -> LogitControlsBatch:
        """controls[i], token_ids[rows[i]], num_prompt_tokens[i] and num_tokens[i] belong to sampling row i."""
        batch = cls()
        bias = [(i, c) for i, c in enumerate(controls) if c is not None and len(c.bias_ids)]
        if bias:
            batch.bias_rows = torch.tensor(np.repeat([i for i, _ in bias], [len(c.bias_ids) for _, c in bias]),
                                           device=device)
            batch.bias_ids = torch.from_numpy(np.concatenate([c.bias_ids for _, c in bias])).to(device)
            batch.bias_values = torch.from_numpy(np.concatenate([c.bias_values for _, c in bias])).to(device)
        allowed = [(i, c) for i, c in enumerate(controls) if c is not None and c.allowed_bitmask is not None]
        if allowed:
            batch.allowed_rows = torch.tensor([i for i, _ in allowed], dtype=torch.int64)
            batch.allowed_bitmask = stack_bitmasks([c.allowed_bitmask for _, c in allowed], vocab_size)
        banned = [(i, token_id) for i, c in enumerate(controls) if c is not None and c.bad_words
                  for token_id in c.banned_by_bad_words(token_ids[rows[i], num_prompt_tokens[i]:num_tokens[i]])]
        if banned:
            banned_rows, banned_ids = zip(*banned)
            batch.banned_rows = torch.tensor(banned_rows, dtype=torch.int64, device=device)
            batch.banned_ids = torch.tensor(banned_ids, dtype=torch.int64, device=device)
        return batch

    def apply(self, logits: torch.Tensor) -> None:
        """In vLLM's order: the allowed-token mask, bad words, then the biases (a bias cannot revive a
        token the mask or a bad word removed: -inf plus a bias stays -inf)."""
        if self.allowed_rows is not None:
            apply_token_bitmask(logits, self.allowed_bitmask, self.allowed_rows)
        if self.banned_rows is not None:
            logits[self.banned_rows, self.banned_ids] = -math.inf
        if self.bias_rows is not None:
            logits.index_put_((self.bias_rows, self.bias_ids), self.bias_values, accumulate=True)
