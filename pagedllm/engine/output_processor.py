"""From appended tokens to user-facing outputs: detokenize, check stop strings, group samples and beams.

A user request with n > 1 (or best_of) runs as child requests that share the prompt, and a beam
search as the beams of its BeamSearch; this module keeps them together and reports each user
request as one RequestOutput.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ChildState:
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)   # per output token, when asked
    num_reported_tokens: int = 0   # for DELTA outputs: tokens already sent


class ParentRequest:
    """One user request: its prompt, its params and the child sequences that answer it."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, children: list[ChildState]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.children = children
        # Position by position (None first: nothing scores the first token), filled as prefill chunks run.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if params.prompt_logprobs is None else [None] * len(prompt_token_ids))
        self._prompt_logprobs_reported = False   # DELTA outputs carry them once, in the first output

    def add_prompt_logprobs(self, first_position: int, entries: list[dict[int, Logprob]]) -> None:
        """Stores a chunk's entries by position: a prefix recomputed after preemption rewrites equal values."""
        self.prompt_logprobs[first_position:first_position + len(entries)] = entries

    @property
    def finished(self) -> bool:
        return all(child.request.is_finished for child in self.children)

    def unfinished_requests(self) -> list[Request]:
        return [child.request for child in self.children if not child.request.is_finished]

    def make_output(self) -> RequestOutput | None:
        """The output the request's output_kind asks for now; None when there is nothing to report."""
        kind = self.params.output_kind
        finished = self.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        children = self.children
        if finished and len(children) > self.params.n:
            # best_of: keep the n samples the model found most likely.
            children = sorted(children, key=lambda c: c.request.cumulative_logprob, reverse=True)
            children = children[:self.params.n]
        outputs = [_completion(child, index, kind is RequestOutputKind.DELTA)
                   for index, child in enumerate(children)]
        error = next((c.request.error for c in self.children if c.request.error), None)
        prompt_logprobs = self.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if self._prompt_logprobs_reported else prompt_logprobs
            self._prompt_logprobs_reported = True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=self.num_cached_tokens,
                             num_pinned_tokens=self.children[0].request.num_pinned_tokens, error=error)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the first child (the one that runs the prefill) found in the prefix cache."""
        request = self.children[0].request
        return min(request.num_cached_tokens, request.num_prompt_tokens)


def _completion(child: ChildState, index: int, delta: bool) -> CompletionOutput:
    request = child.request
    status = request.status
    finished = status.is_finished
    start = child.num_reported_tokens if delta else 0
    child.num_reported_tokens = request.num_output_tokens
    wants_logprobs = request.sampling_params.logprobs is not None
    return CompletionOutput(
        index=index,
        text=child.detokenizer.stream_delta(finished) if delta else child.detokenizer.visible_text(finished),
        token_ids=request.all_token_ids[request.num_prompt_tokens + start:],
        cumulative_logprob=request.cumulative_logprob if wants_logprobs else None,
        logprobs=child.logprobs[start:] if wants_logprobs else None,
        finish_reason=status.value if finished else None,
        stop_reason=request.stop_reason,
    )


class BeamSearchParent:
    """A user request answered by beam search: reported once, when the search ends, as its best beams."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], search: BeamSearch,
                 tokenizer):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.search = search
        self.tokenizer = tokenizer

    @property
    def finished(self) -> bool:
        return self.search.finished

    def unfinished_requests(self) -> list[Request]:
        return [beam.request for beam in self.search.live]

    def make_output(self) -> RequestOutput | None:
        if not self.finished:
            return None
        outputs = [CompletionOutput(index=index, text=self.tokenizer.decode(sequence.output_token_ids),
                                    token_ids=sequence.output_token_ids, cumulative_logprob=sequence.cum_logprob,
                                    logprobs=sequence.logprobs, finish_reason=sequence.finish_reason)
                   for index, sequence in enumerate(self.search.best())]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished=True)


def process_token(child: ChildState, token_id: int, top_logprobs: dict[int, Logprob] | None) -> str | None:
    """Takes in a token the scheduler appended (and checked against the token-level stops); returns the
    stop string it completed, if any.

    A token that ended the request (EOS or a stop_token_id) adds no text, as in vLLM, unless
    include_stop_str_in_output is set.
    """
    request = child.request
    if top_logprobs is not None:
        child.logprobs.append(top_logprobs)
    if request.status is RequestStatus.FINISHED_STOPPED:   # only a token stop can have ended it yet
        if request.sampling_params.include_stop_str_in_output:
            child.detokenizer.append([token_id])
        return None
    return child.detokenizer.append([token_id])
