"""Beam search on the engine, with beams sharing KV blocks.

Every live beam is a request in the scheduler. Each step, a beam's row yields
its 2 * beam_width most likely next tokens (raw logprobs); once every live beam
of a prompt has them, the beam_width best extensions by cumulative logprob are
kept. A kept beam that extends a parent continues as that parent's request; a
second extension of the same parent is forked from it, sharing all its blocks
(copy on write for the partly filled last one); a parent with no kept extension
is finished, freeing its blocks. Beams that reach EOS (unless ignore_eos) or
max_tokens are complete; the best beam_width of all complete beams, by
cumulative logprob / generated_length ** length_penalty, are returned.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams


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
    sequence: BeamSearchSequence
    candidates: list[tuple[int, float]] | None = None   # (token, logprob), filled when the row samples


@dataclass
class _Prompt:
    live: list[_Beam]
    complete: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(engine: LLMEngine, prompts: list[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
    width = params.beam_width
    sampling = SamplingParams(temperature=0, max_tokens=params.max_tokens, logprobs=2 * width, ignore_eos=True)
    ids = (f"beam-{n}" for n in itertools.count())
    beams: dict[str, _Beam] = {}
    searches = []
    for prompt in prompts:
        checked = engine.check_prompt(prompt, sampling)
        prompt_ids = checked.token_ids
        request = Request(next(ids), prompt_ids, sampling, engine.model_config.eos_token_ids, checked.max_tokens,
                          cache_salt=checked.cache_salt)
        beam = _Beam(request, BeamSearchSequence(list(prompt_ids), [], 0.0, num_prompt_tokens=len(prompt_ids)))
        beams[request.request_id] = beam
        engine.scheduler.add_request(request)
        searches.append(_Prompt([beam]))
    try:
        while any(search.live for search in searches):
            sampled, samples = engine.run_step()
            if samples is None:
                continue
            top_ids, top_values = samples.top_logprob_ids.tolist(), samples.top_logprobs.tolist()
            for row, request in enumerate(sampled):
                beams[request.request_id].candidates = list(zip(top_ids[row], top_values[row]))
            for search in searches:
                if search.live and all(beam.candidates is not None for beam in search.live):
                    _advance(engine, search, params, beams, ids)
    finally:
        for beam in beams.values():
            if not beam.request.is_finished:
                engine.finish_request(beam.request, RequestStatus.FINISHED_ABORTED)
    tokenizer = engine.tokenizer
    outputs = []
    for search in searches:
        best = sorted(search.complete, key=lambda seq: _score(seq, params.length_penalty), reverse=True)[:width]
        for sequence in best:
            sequence.text = tokenizer.decode(sequence.output_token_ids)
        outputs.append(BeamSearchOutput(best))
    return outputs


def _score(sequence: BeamSearchSequence, length_penalty: float) -> float:
    """As transformers: a closing EOS does not count towards the length that is penalised."""
    length = len(sequence.output_token_ids) - (sequence.finish_reason == "stop")
    return sequence.cum_logprob / (max(length, 1) ** length_penalty)


def _advance(engine: LLMEngine, search: _Prompt, params: BeamSearchParams, beams: dict[str, _Beam], ids) -> None:
    """Keeps the beam_width best one-token extensions of the prompt's live beams."""
    extensions = sorted(((beam.sequence.cum_logprob + logprob, index, token, logprob)
                         for index, beam in enumerate(search.live) for token, logprob in beam.candidates),
                        key=lambda e: e[0], reverse=True)[:params.beam_width]
    kept_by_parent: dict[int, list[tuple[float, int, float]]] = {}
    for score, index, token, logprob in extensions:
        kept_by_parent.setdefault(index, []).append((score, token, logprob))
    next_live = []
    for index, parent in enumerate(search.live):
        kept = kept_by_parent.get(index)
        if kept is None:
            engine.finish_request(parent.request, RequestStatus.FINISHED_ABORTED)
            del beams[parent.request.request_id]
            continue
        # Forks first: they must copy the parent before it takes its own next token.
        extended = [parent]
        for _ in kept[1:]:
            child = Request(next(ids), parent.request.prompt_token_ids, parent.request.sampling_params,
                            parent.request.eos_token_ids, parent.request.max_tokens,
                            cache_salt=parent.request.cache_salt)
            engine.fork(parent.request, child)
            seq = parent.sequence
            extended.append(_Beam(child, BeamSearchSequence(list(seq.tokens), list(seq.logprobs), seq.cum_logprob,
                                                            num_prompt_tokens=seq.num_prompt_tokens)))
            beams[child.request_id] = extended[-1]
        for beam, (score, token, logprob) in zip(extended, kept):
            beam.candidates = None
            beam.request.all_token_ids.append(token)
            sequence = beam.sequence
            sequence.tokens.append(token)
            sequence.logprobs.append({token: Logprob(logprob)})
            sequence.cum_logprob = score
            hit_eos = token in beam.request.eos_token_ids and not params.ignore_eos
            if hit_eos or beam.request.num_output_tokens >= beam.request.max_tokens:
                sequence.finish_reason = "stop" if hit_eos else "length"
                search.complete.append(sequence)
                engine.finish_request(beam.request, RequestStatus.FINISHED_STOPPED)
                del beams[beam.request.request_id]
            else:
                next_live.append(beam)
    search.live = next_live
