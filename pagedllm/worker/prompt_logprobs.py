"""Prompt logprobs from the step's own forward pass: which token rows need logits, and their log-softmax.

The logits at position j score the prompt token at j + 1, so a request asking for prompt logprobs
adds the logits rows of its prompt positions the step computes (but the last prompt position, which
samples). A prompt prefilled in chunks gets each chunk's share in that chunk's step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.step import PromptLogprobs


@dataclass
class PromptLogprobsPlan:
    """The step's extra logits rows: token indices in the step, the prompt token each one scores."""
    token_indices: np.ndarray    # int64, into the step's flat tokens
    target_ids: np.ndarray       # int64, the prompt token scored by each row
    num_top: np.ndarray          # int64, the top-k each row's request asked for
    requests: list[tuple[str, int, int]]   # (request id, first scored prompt position, count), rows in order

    @classmethod
    def for_step(cls, num_prompt_logprobs: np.ndarray, req_ids: list[str], rows: np.ndarray, num_new: np.ndarray,
                 num_computed: np.ndarray, num_prompt_tokens: np.ndarray, token_ids: np.ndarray
                 ) -> PromptLogprobsPlan | None:
        """rows, num_new: the step's rows and their token counts, in step order; the other arrays are the
        batch's, indexed by row. None when no row in the step asks for prompt logprobs."""
        asking = np.flatnonzero(num_prompt_logprobs[rows] >= 0)
        if not len(asking):
            return None
        row_starts = np.cumsum(num_new) - num_new
        indices, targets, tops, requests = [], [], [], []
        for k in asking.tolist():
            row, start = rows[k], int(num_computed[rows[k]])
            end = min(start + int(num_new[k]), int(num_prompt_tokens[row]) - 1)   # positions start..end-1
            if end <= start:
                continue
            indices.append(row_starts[k] + np.arange(end - start))
            targets.append(token_ids[row, start + 1:end + 1].astype(np.int64))
            tops.append(np.full(end - start, num_prompt_logprobs[row], np.int64))
            requests.append((req_ids[row], start + 1, end - start))
        if not requests:
            return None
        return cls(np.concatenate(indices), np.concatenate(targets), np.concatenate(tops), requests)


def compute_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobsPlan) -> dict[str, PromptLogprobs]:
    """Each scored prompt token's logprob and rank under the raw distribution, and its request's top-k."""
    logits = logits.float()
    targets = torch.from_numpy(plan.target_ids).to(logits.device).unsqueeze(1)
    log_normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
    target_logits = logits.gather(1, targets)
    token_logprobs = (target_logits - log_normaliser).squeeze(1).tolist()
    ranks = ((logits > target_logits).sum(dim=-1) + 1).tolist()
    max_top = int(plan.num_top.max())
    top_ids = top_values = None
    if max_top:
        top_values, top_ids = logits.topk(max_top, dim=-1)
        top_values = (top_values - log_normaliser).tolist()
        top_ids = top_ids.tolist()
    result, row = {}, 0
    for request_id, first_position, count in plan.requests:
        k = int(plan.num_top[row])
        rows = range(row, row + count)
        result[request_id] = PromptLogprobs(
            first_position=first_position,
            token_logprobs=token_logprobs[row:row + count],
            token_ranks=ranks[row:row + count],
            top_ids=[top_ids[i][:k] if k else [] for i in rows],
            top_logprobs=[top_values[i][:k] if k else [] for i in rows])
        row += count
    return result
