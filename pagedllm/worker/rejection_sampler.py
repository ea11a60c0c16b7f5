"""Verification of proposals against the target model's distributions, so that the output is distributed
exactly as the target's decoding one token at a time (Leviathan et al., Chen et al. 2023):

- greedy: accept the longest prefix of proposals equal to the target's argmax, then add the argmax at
  the first mismatch (or after the last proposal: the bonus token);
- sampling: accept proposal d drawn from q with probability min(1, p(d) / q(d)); at the first rejection
  draw the target's token from max(0, p - q), normalised; with every proposal accepted draw the bonus
  token from p. N-gram proposals are not drawn from any distribution: q is one-hot on them.

p is what the sampler would draw from at that position (penalties, min_tokens, temperature, top-k/p,
min-p), computed on rows whose context holds the proposals before them: each accepted token is chosen as
if the tokens before it had been decoded one by one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.worker.sampler import (SamplingBatch, argmax_rows, changes_logits, draw, normaliser_and_argmax,
                                     penalised_logits, probabilities)


@dataclass
class Proposal:
    """One request's proposals in a verification step."""
    first_row: int                    # its first verification row: the decode token's, then one per proposal
    token_ids: list[int]
    draft_probs: torch.Tensor | None  # [k, vocab]: the distribution each proposal was drawn from; None: one-hot
    greedy: bool
    generator: torch.Generator | None   # a seeded request's: its accept draws and resample come from it


def accept(target_probs: torch.Tensor, token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
           uniforms: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The p/q rule for one request: target_probs [k + 1, vocab] (row i: p before proposal i, row k: after
    the last), proposals [k], draft_probs [k, vocab] or None (one-hot), uniforms [k] in [0, 1).

    Returns (proposals accepted, the unnormalised distribution the target's own token is drawn from)."""
    k = len(token_ids)
    positions = torch.arange(k)
    p = target_probs[positions, token_ids]
    q = torch.ones(k) if draft_probs is None else draft_probs[positions, token_ids]
    accepted = uniforms * q < p   # probability min(1, p / q); never a token p rules out
    num_accepted = k if bool(accepted.all()) else int(accepted.to(torch.int8).argmin())
    if num_accepted == k:
        return k, target_probs[k].clone()
    row = target_probs[num_accepted]
    if draft_probs is None:
        residual = row.clone()
        residual[token_ids[num_accepted]] = 0
    else:
        residual = (row - draft_probs[num_accepted]).clamp_(min=0)
    if not bool((residual > 0).any()):   # rounding left no mass: p and q agree, so p itself is exact
        residual = row.clone()
    return num_accepted, residual


def verify(raw_logits: torch.Tensor, batch: SamplingBatch, proposals: list[Proposal]
           ) -> tuple[list[list[int]], list[int], torch.Tensor]:
    """raw_logits [rows, vocab] float32: every proposing request's 1 + k rows, batch built row for row.
    Returns each request's tokens (accepted proposals, then the target's own), for every token in that
    order its row in raw_logits, and each row's log normaliser (the logprobs need it too: one pass finds it
    with the raw argmax)."""
    changed = changes_logits(batch)
    log_normaliser, raw_best = normaliser_and_argmax(raw_logits, need_argmax=not changed)
    logits = penalised_logits(raw_logits, batch) if changed else raw_logits
    greedy_ids = (argmax_rows(logits) if changed else raw_best).tolist()
    probs = None if batch.all_greedy else probabilities(logits.clone() if logits is raw_logits else logits, batch)
    tokens_per_request: list[list[int]] = []
    rows: list[int] = []
    finals, final_slots, seeded = [], [], []
    for proposal in proposals:
        first, k = proposal.first_row, len(proposal.token_ids)
        if proposal.greedy:
            num_accepted = 0
            while num_accepted < k and proposal.token_ids[num_accepted] == greedy_ids[first + num_accepted]:
                num_accepted += 1
            tokens = proposal.token_ids[:num_accepted] + [greedy_ids[first + num_accepted]]
        else:
            uniforms = torch.rand(k, generator=proposal.generator)
            num_accepted, final = accept(probs[first:first + k + 1], torch.tensor(proposal.token_ids),
                                         proposal.draft_probs, uniforms)
            if proposal.generator is not None:
                seeded.append((len(finals), proposal.generator))
            final_slots.append(len(tokens_per_request))
            finals.append(final)
            tokens = proposal.token_ids[:num_accepted] + [-1]   # the draw below fills it in
        tokens_per_request.append(tokens)
        rows.extend(range(first, first + num_accepted + 1))
    if finals:
        for slot, token_id in zip(final_slots, draw(torch.stack(finals), seeded).tolist()):
            tokens_per_request[slot][-1] = token_id
    return tokens_per_request, rows, log_normaliser
