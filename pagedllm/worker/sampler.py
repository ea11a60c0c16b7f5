"""Picks one token per row for a whole batch with tensor ops, each row following its own SamplingParams.

Everything runs on the logits' device. Host arrays go there with non_blocking copies: from pageable memory
CUDA stages them at once and the host does not wait for the GPU, so the step's one wait stays the runner's
fetch of the sampled ids."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.model.kernels import kernel_for
from pagedllm.worker.input_batch import RowFeature, SamplingColumns
from pagedllm.worker.logit_controls import LogitControlsBatch
from pagedllm.worker.token_bitmask import bitmask_words


def _token_counts(token_ids: np.ndarray, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, vocab_size: int,
                  device) -> torch.Tensor:
    """[len(rows), vocab_size] float32: how often each id occurs in token_ids[rows[i], starts[i]:ends[i]].

    Slots outside a row's span take the id vocab_size, counted in an extra column and dropped,
    so one scatter_add serves every row whatever its length.
    """
    width = int(ends.max(initial=0))
    ids = torch.from_numpy(token_ids[rows, :width].astype(np.int64))
    column = torch.arange(width)
    inside = (column >= torch.from_numpy(starts).unsqueeze(1)) & (column < torch.from_numpy(ends).unsqueeze(1))
    ids = torch.where(inside, ids, vocab_size).to(device, non_blocking=True)
    counts = torch.zeros(len(starts), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


@dataclass
class SamplingBatch:
    """A step's sampling tensors, gathered from the persistent batch's columns for the rows that sample.

    A feature no row uses is None, so `sample` skips its work entirely.
    """

    temperatures: torch.Tensor | None                 # [num_seqs, 1]; 1.0 on greedy rows; None when all are greedy
    all_greedy: bool
    seeded_rows: list[tuple[int, torch.Generator]]   # non-greedy rows that own a generator
    num_top_logprobs: int | None                      # max over rows asking for logprobs; None if none asks
    greedy: torch.Tensor | None = None                # [num_seqs] bool, where greedy rows mix with sampled ones
    top_k: torch.Tensor | None = None                 # [num_seqs, 1] int64; vocab_size where off
    top_p: torch.Tensor | None = None                 # [num_seqs, 1]; inf where off
    log_min_p: torch.Tensor | None = None             # [num_seqs, 1]; -inf where off
    repetition_penalties: torch.Tensor | None = None  # [num_seqs, 1]
    seen_tokens: torch.Tensor | None = None           # [num_seqs, vocab] bool: in prompt or output
    frequency_penalties: torch.Tensor | None = None   # [num_seqs, 1]
    presence_penalties: torch.Tensor | None = None    # [num_seqs, 1]
    output_counts: torch.Tensor | None = None         # [num_seqs, vocab] float32
    min_tokens_rows: torch.Tensor | None = None       # with min_tokens_ids: (row, id) pairs to ban
    min_tokens_ids: torch.Tensor | None = None
    logit_controls: LogitControlsBatch | None = None   # logit_bias, allowed_token_ids, bad_words

    @classmethod
    def build(cls, columns: SamplingColumns, rows: np.ndarray, token_ids: np.ndarray, num_prompt_tokens: np.ndarray,
              num_tokens: np.ndarray, vocab_size: int, device) -> SamplingBatch:
        """`rows` index the columns and token_ids in output order; token_ids[rows[i]] holds a prompt, then its
        output (num_prompt_tokens[i] and num_tokens[i] long), read only when a penalty needs counts."""
        def column(values: np.ndarray) -> torch.Tensor:
            """A per-row parameter as a [num_seqs, 1] column that broadcasts over the vocabulary."""
            return torch.from_numpy(values).to(device, non_blocking=True).unsqueeze(1)

        greedy = columns.greedy[rows]
        used = RowFeature(int(np.bitwise_or.reduce(columns.features[rows]))) if len(rows) else RowFeature(0)
        num_logprobs = columns.num_logprobs[rows] if used & RowFeature.LOGPROBS else None
        seeded = np.flatnonzero(columns.seeded[rows] & ~greedy) if used & RowFeature.SEEDED else ()
        all_greedy = bool(greedy.all())
        batch = cls(
            # Only a draw reads these: a step of greedy rows (most decode steps) makes neither tensor.
            temperatures=None if all_greedy else column(columns.temperature[rows]),
            all_greedy=all_greedy,
            seeded_rows=[(int(i), columns.generators[rows[i]]) for i in seeded],
            num_top_logprobs=None if num_logprobs is None else int(num_logprobs.max()),
        )
        if not all_greedy and greedy.any():
            batch.greedy = torch.from_numpy(greedy).to(device, non_blocking=True)
        if used & RowFeature.TOP_K:
            top_k = columns.top_k[rows]
            batch.top_k = column(np.where(top_k > 0, top_k, vocab_size))
        if used & RowFeature.TOP_P:
            batch.top_p = column(columns.top_p[rows])
        if used & RowFeature.MIN_P:
            batch.log_min_p = column(columns.log_min_p[rows])
        if used & RowFeature.REPETITION:
            batch.repetition_penalties = column(columns.repetition_penalty[rows])
            everything = np.zeros_like(num_tokens)   # from the first prompt token
            batch.seen_tokens = _token_counts(token_ids, rows, everything, num_tokens, vocab_size, device) > 0
        if used & RowFeature.FREQUENCY_PRESENCE:
            batch.frequency_penalties = column(columns.frequency_penalty[rows])
            batch.presence_penalties = column(columns.presence_penalty[rows])
            batch.output_counts = _token_counts(token_ids, rows, num_prompt_tokens, num_tokens, vocab_size, device)
        if used & RowFeature.MIN_TOKENS:   # closes every way of stopping on a token: EOS and stop_token_ids
            short = np.flatnonzero(num_tokens - num_prompt_tokens < columns.min_tokens[rows])
            banned = [(int(i), token_id) for i in short for token_id in columns.stop_ids[rows[i]]]
            if banned:
                banned_rows, ids = zip(*banned)
                batch.min_tokens_rows = torch.tensor(banned_rows, dtype=torch.int64).to(device, non_blocking=True)
                batch.min_tokens_ids = torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)
        if used & RowFeature.LOGIT_CONTROLS:
            batch.logit_controls = LogitControlsBatch.build([columns.logit_controls[row] for row in rows.tolist()],
                                                            token_ids, rows, num_prompt_tokens, num_tokens,
                                                            vocab_size, device)
        return batch


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor               # [num_seqs] int64
    logprobs: torch.Tensor                # [num_seqs] float32: logprob of the sampled token
    top_logprob_ids: torch.Tensor | None  # [num_seqs, max_k] by falling logprob; None if no row asks
    top_logprobs: torch.Tensor | None     # [num_seqs, max_k]
    token_ranks: torch.Tensor | None      # [num_seqs] rank of the sampled token (1 = most likely); None if no row asks


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition penalty (HF/vLLM, prompt and output), then OpenAI frequency/presence (output only)."""
    if batch.seen_tokens is not None:
        penalty = batch.repetition_penalties
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(batch.seen_tokens, penalized, logits))
    if batch.output_counts is not None:
        counts = batch.output_counts
        logits -= batch.frequency_penalties * counts
        logits -= batch.presence_penalties * (counts > 0)


# csrc's truncate_top_k_top_p for CPU logits, or None (the sort below): chosen once, at start-up.
_CPU_TRUNCATE = kernel_for("truncate_top_k_top_p", torch.device("cpu"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Masks to -inf what top-k and then top-p drop. On CPU the kernel finds the same kept set without sorting
    the vocabulary (a full sort of every row was most of a sampled step); elsewhere one sort serves both."""
    if _CPU_TRUNCATE is not None and logits.is_cpu and logits.dtype == torch.float32 and logits.is_contiguous():
        _CPU_TRUNCATE(logits, None if top_k is None else top_k.reshape(-1).contiguous(),
                      None if top_p is None else top_p.reshape(-1).contiguous())
    else:
        _top_k_top_p_by_sort(logits, top_k, top_p)


def _top_k_top_p_by_sort(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """_apply_top_k_top_p's torch formula: one sort of every row, shared by both."""
    # Stable, so among equal logits the lowest id ranks first, as argmax picks it.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(rank >= top_k, -math.inf)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        # Keep a token while the better ones hold less than top_p; the best one always stays, even when
        # top_p is below float32's smallest number.
        drop = mass_above >= top_p
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, -math.inf)
    logits.scatter_(1, order, sorted_logits)


def draw(probs: torch.Tensor, seeded_rows: list[tuple[int, torch.Generator]]) -> torch.Tensor:
    """A draw from each row of probs (normalised or not): the first token whose cumulative mass passes a uniform
    share of the row's total. One uniform per row, so a seeded row depends on its generator alone, and one pass
    over the row (an exponential race would draw a noise value per token of the vocabulary)."""
    uniforms = torch.empty(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    if len(seeded_rows) < probs.shape[0]:
        uniforms.uniform_()
    for row, generator in seeded_rows:
        uniforms[row].uniform_(generator=generator)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    chosen = torch.searchsorted(cdf, uniforms * total, right=True)
    # u * total may round up to the total: the last token with mass is where the cdf first reaches it.
    return torch.minimum(chosen, torch.searchsorted(cdf, total)).squeeze(1)


def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution a non-greedy row samples from, from its penalised logits (changed in place):
    temperature, then top-k / top-p, min-p, softmax."""
    logits /= batch.temperatures
    if batch.top_k is not None or batch.top_p is not None:
        _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    if batch.log_min_p is not None:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p): no softmax needed.
        threshold = logits.amax(dim=-1, keepdim=True) + batch.log_min_p
        logits.masked_fill_(logits < threshold, -math.inf)
    return logits.softmax(dim=-1)


def _choose(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids from penalised logits: argmax on greedy rows, a truncated-distribution draw elsewhere."""
    if batch.all_greedy:
        return argmax_rows(logits)
    greedy_ids = argmax_rows(logits) if batch.greedy is not None else None
    sampled = draw(probabilities(logits, batch), batch.seeded_rows)
    return sampled if greedy_ids is None else torch.where(batch.greedy, greedy_ids, sampled)


# csrc's logits_summary for CPU logits, or None (torch's logsumexp and argmax): chosen once, at start-up.
_CPU_LOGITS_SUMMARY = kernel_for("logits_summary", torch.device("cpu"))


def normaliser_and_argmax(raw_logits: torch.Tensor, need_argmax: bool
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logsumexp per row ([rows, 1]: log p = logit - it, no [rows, vocab] log-softmax written),
    and the argmax per row where asked; on CPU one kernel gives both in two passes over a row."""
    summary = _CPU_LOGITS_SUMMARY if raw_logits.is_cpu else None   # an engine's logits stay on its device
    if summary is not None:
        log_normaliser = raw_logits.new_empty(raw_logits.shape[0])
        best = torch.empty(raw_logits.shape[0], dtype=torch.int64)
        summary(log_normaliser, best, raw_logits.contiguous())
        return log_normaliser.unsqueeze(1), best
    log_normaliser = torch.logsumexp(raw_logits, dim=-1, keepdim=True)
    return log_normaliser, raw_logits.argmax(dim=-1) if need_argmax else None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the lowest id among equal maxima (as torch's argmax); on CPU logits_summary's vectorised pass,
    which beats torch's argmax over vocabulary-wide rows even with the logsumexp it also computes."""
    if _CPU_LOGITS_SUMMARY is None or not logits.is_cpu:
        return logits.argmax(dim=-1)
    return normaliser_and_argmax(logits, need_argmax=True)[1]


def changes_logits(batch: SamplingBatch) -> bool:
    """Whether some row's logits are changed before choosing (logit controls, min_tokens, penalties)."""
    return (batch.min_tokens_rows is not None or batch.seen_tokens is not None or batch.output_counts is not None
            or batch.logit_controls is not None)


def penalised_logits(raw_logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """A copy of the raw logits with the logit controls, min_tokens' bans and the penalties applied (vLLM's
    order): what greedy rows take the argmax of, and sampled rows' distributions start from."""
    logits = raw_logits.clone()
    if batch.logit_controls is not None:
        batch.logit_controls.apply(logits)
    if batch.min_tokens_rows is not None:
        logits[batch.min_tokens_rows, batch.min_tokens_ids] = -math.inf
    _apply_penalties(logits, batch)
    return logits


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """One token per row of logits [num_seqs, vocab], with logprobs of the raw (unprocessed) distribution."""
    raw_logits = logits.float()
    token_ids, log_normaliser = choose_tokens(raw_logits, batch)
    return summarise(raw_logits, token_ids, batch.num_top_logprobs, log_normaliser)


def choose_tokens(raw_logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """One token id per row of float32 raw logits, and the rows' log normalisers (logsumexp)."""
    plain_greedy = batch.all_greedy and not changes_logits(batch)
    log_normaliser, raw_best = normaliser_and_argmax(raw_logits, need_argmax=plain_greedy)
    if plain_greedy:
        token_ids = raw_best
    elif (batch.all_greedy and _sparse_changes_only(batch) and _CPU_CONTROLLED_ARGMAX is not None
          and raw_logits.is_cpu):
        token_ids = _controlled_argmax(raw_logits, batch)
    else:
        token_ids = _choose(penalised_logits(raw_logits, batch), batch)
    return token_ids, log_normaliser


# csrc's controlled_argmax for CPU logits, or None (penalised_logits' copy): chosen once, at start-up.
_CPU_CONTROLLED_ARGMAX = kernel_for("controlled_argmax", torch.device("cpu"))


def _sparse_changes_only(batch: SamplingBatch) -> bool:
    """Whether the logits change only by the logit controls and min_tokens' bans (no penalties, which change
    every seen token)."""
    return batch.seen_tokens is None and batch.output_counts is None


def _controlled_argmax(raw_logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """penalised_logits(raw_logits, batch).argmax(-1) without the copy (the kernel restores what it changes),
    for batches whose changes are only the logit controls and min_tokens' bans: the allowed-token bitmask, then
    the bans (-inf) and biases added (vLLM's order gives the same sums: -inf plus a bias stays -inf)."""
    num_rows, vocab_size = raw_logits.shape
    controls = batch.logit_controls
    bans = [(batch.min_tokens_rows, batch.min_tokens_ids)]
    if controls is not None:
        bans.append((controls.banned_rows, controls.banned_ids))
    changes = [(rows, ids, torch.full(ids.shape, -math.inf)) for rows, ids in bans if rows is not None]
    if controls is not None and controls.bias_rows is not None:
        changes.append((controls.bias_rows, controls.bias_ids, controls.bias_values))
    if not changes:
        changes = [(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), torch.empty(0))]
    rows, ids, values = (torch.cat(column) for column in zip(*changes))
    order = rows.argsort(stable=True)   # each row's changes together, as the kernel reads them
    starts = torch.zeros(num_rows + 1, dtype=torch.int64)
    starts[1:] = torch.bincount(rows, minlength=num_rows).cumsum(0)
    bitmask_index = torch.full((num_rows,), -1, dtype=torch.int64)
    if controls is not None and controls.allowed_rows is not None:
        bitmask = torch.from_numpy(controls.allowed_bitmask)
        bitmask_index[controls.allowed_rows] = torch.arange(len(controls.allowed_rows))
    else:
        bitmask = torch.empty(0, bitmask_words(vocab_size), dtype=torch.int32)
    best = torch.empty(num_rows, dtype=torch.int64)
    _CPU_CONTROLLED_ARGMAX(best, raw_logits.contiguous(), bitmask.contiguous(), bitmask_index, starts,
                           ids[order].contiguous(), values[order].float().contiguous())
    return best


def summarise(raw_logits: torch.Tensor, token_ids: torch.Tensor, num_top_logprobs: int | None,
              log_normaliser: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> SamplerOutput:
    """The chosen tokens with their logprobs under the raw distribution of each row of float32 raw_logits,
    and where num_top_logprobs is not None the most likely tokens and the chosen one's rank.

    log_normaliser: each raw_logits row's logsumexp, where the caller has it. rows: token i's row of raw_logits
    (default: row i), so that a verification's accepted rows are read in place rather than copied out."""
    if log_normaliser is None:
        log_normaliser, _ = normaliser_and_argmax(raw_logits, need_argmax=False)
    if rows is None:
        token_logits = raw_logits.gather(1, token_ids.unsqueeze(1))
    else:
        token_logits = raw_logits[rows, token_ids].unsqueeze(1)
        log_normaliser = log_normaliser[rows]
        if num_top_logprobs is not None:   # the top tokens and ranks read whole rows
            raw_logits = raw_logits[rows]
    top_ids = top_values = ranks = None
    if num_top_logprobs is not None:
        top_values, top_ids = raw_logits.topk(num_top_logprobs, dim=-1)
        top_values -= log_normaliser
        ranks = (raw_logits > token_logits).sum(dim=-1) + 1
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=(token_logits - log_normaliser).squeeze(1),
        top_logprob_ids=top_ids,
        top_logprobs=top_values,
        token_ranks=ranks,
    )
