"""Beam search as ordinary engine requests, with beams sharing KV blocks.

Every live beam is a request in the scheduler, marked with its BeamSearch. Each step, a beam's row
yields its 2 * beam_width most likely next tokens (raw logprobs), which the scheduler hands to the
search instead of appending a token; once every live beam of the prompt has them, the beam_width
best extensions by cumulative logprob are kept. A kept beam that extends a parent continues as that
parent's request; a second extension of the same parent is forked from it, sharing all its blocks
(copy on write for the partly filled last one); a parent with no kept extension is finished, freeing
its blocks. Beams that reach EOS (unless ignore_eos) or max_tokens are complete; the best beam_width
of all complete beams, by cumulative logprob / generated_length ** length_penalty, are the result.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.engine.request import Request, RequestStatus
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:   # the scheduler calls into the search; the search only calls back
    from pagedllm.engine.scheduler import Scheduler


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        limit = MAX_LOGPROBS // 2
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= limit:
            raise ValueError(f"beam_width must be an integer in [1, {limit}], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")

    def sampling_params(self) -> SamplingParams:
        """What each beam's row asks of the sampler: the raw top 2 * beam_width logprobs."""
        return SamplingParams(temperature=0, max_tokens=self.max_tokens, logprobs=2 * self.beam_width,
                              ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's shape): `tokens` holds the prompt and the generated tokens."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    request: Request
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    candidates: list[tuple[int, float]] | None = None   # (token, logprob), set when its row samples


class BeamSearch:
    """One prompt's search: its live beams (requests in the scheduler) and the beams it completed."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: tuple[int, ...], max_tokens: int, cache_salt: str | None = None,
                 arrival_time: float | None = None, priority: int = 0, lora_request: LoRARequest | None = None):
        self.params = params
        self._ids = (f"{request_id}-beam-{n}" for n in itertools.count())
        first = Request(next(self._ids), prompt_token_ids, params.sampling_params(), eos_token_ids, max_tokens,
                        priority=priority, cache_salt=cache_salt, beam_search=self, lora_request=lora_request,
                        **({} if arrival_time is None else {"arrival_time": arrival_time}))
        self.live: list[_Beam] = [_Beam(first, [])]
        self.complete: list[BeamSearchSequence] = []

    @property
    def first_request(self) -> Request:
        return self.live[0].request

    @property
    def finished(self) -> bool:
        return not self.live

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best complete beams, best first."""
        return sorted(self.complete, key=self._score, reverse=True)[:self.params.beam_width]

    def _score(self, sequence: BeamSearchSequence) -> float:
        """As transformers: a closing EOS does not count towards the length that is penalised."""
        length = len(sequence.output_token_ids) - (sequence.finish_reason == "stop")
        return sequence.cum_logprob / (max(length, 1) ** self.params.length_penalty)

    def add_candidates(self, request: Request, token_ids: list[int], logprobs: list[float]) -> None:
        beam = next(beam for beam in self.live if beam.request is request)
        width = 2 * self.params.beam_width
        beam.candidates = list(zip(token_ids[:width], logprobs[:width]))

    def abort(self, scheduler: Scheduler) -> None:
        for beam in self.live:
            scheduler.finish(beam.request, RequestStatus.FINISHED_ABORTED)
        self.live = []

    def advance_if_ready(self, scheduler: Scheduler) -> None:
        """Once every live beam has its candidates, keeps the beam_width best one-token extensions."""
        if not all(beam.candidates is not None for beam in self.live):
            return
        extensions = sorted(((beam.cum_logprob + logprob, index, token, logprob)
                             for index, beam in enumerate(self.live) for token, logprob in beam.candidates),
                            key=lambda e: e[0], reverse=True)[:self.params.beam_width]
        kept_by_parent: dict[int, list[tuple[float, int, float]]] = {}
        for score, index, token, logprob in extensions:
            kept_by_parent.setdefault(index, []).append((score, token, logprob))
        next_live = []
        for index, parent in enumerate(self.live):
            kept = kept_by_parent.get(index)
            if kept is None:
                scheduler.finish(parent.request, RequestStatus.FINISHED_ABORTED)
                continue
            # Forks first: they must copy the parent before it takes its own next token.
            extended = [parent]
            for _ in kept[1:]:
                source = parent.request
                child = Request(next(self._ids), source.prompt_token_ids, source.sampling_params,
                                source.eos_token_ids, source.max_tokens, arrival_time=source.arrival_time,
                                priority=source.priority, cache_salt=source.cache_salt, beam_search=self,
                                lora_request=source.lora_request)
                scheduler.fork(source, child)
                extended.append(_Beam(child, list(parent.logprobs), parent.cum_logprob))
            for beam, (score, token, logprob) in zip(extended, kept):
                beam.candidates = None
                request = beam.request
                request.all_token_ids.append(token)
                beam.logprobs.append({token: Logprob(logprob)})
                beam.cum_logprob = score
                hit_eos = token in request.eos_token_ids and not self.params.ignore_eos
                if hit_eos or request.num_output_tokens >= request.max_tokens:
                    self.complete.append(BeamSearchSequence(list(request.all_token_ids), beam.logprobs, score,
                                                            finish_reason="stop" if hit_eos else "length",
                                                            num_prompt_tokens=request.num_prompt_tokens))
                    scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                else:
                    next_live.append(beam)
        self.live = next_live
