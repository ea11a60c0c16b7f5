"""From appended tokens to user-facing outputs: detokenize, check stop strings, logprobs, group samples and beams.

A user request with n > 1 (or best_of) runs as child requests that share the prompt, and a beam
search as the beams of its BeamSearch; OutputProcessor keeps them together and reports each user
request as one RequestOutput (vLLM's OutputProcessor).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.pooling import PoolingParent
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.step import ModelRunnerOutput, PromptLogprobs

if TYPE_CHECKING:
    from pagedllm.engine.core import CoreStep

logger = logging.getLogger(__name__)


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


class OutputProcessor:
    """The user requests in flight, by id, and the outputs each step makes for them.

    finish(request, status) ends a request in the engine core: a stop string, or a failure in this
    request's own processing, which must not take its batch down.
    """

    def __init__(self, tokenizer, finish: Callable[[Request, RequestStatus], None]):
        self.tokenizer = tokenizer
        self.finish = finish
        self.parents: dict[str, ParentRequest | BeamSearchParent | PoolingParent] = {}
        self.children: dict[str, ChildState] = {}   # plain and parallel samples (not beams) by request id
        self.parent_of: dict[str, str] = {}
        self.beam_searches: list[BeamSearchParent] = []

    def add(self, parent: ParentRequest | BeamSearchParent | PoolingParent) -> None:
        self.parents[parent.request_id] = parent
        if isinstance(parent, BeamSearchParent):
            self.beam_searches.append(parent)
        elif isinstance(parent, ParentRequest):
            for child in parent.children:
                self.children[child.request.request_id] = child
                self.parent_of[child.request.request_id] = parent.request_id

    def abort(self, request_ids: list[str]) -> list[Request]:
        """Forgets the user requests; returns their unfinished scheduler requests, for the core to drop."""
        unfinished = []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is not None:
                unfinished += parent.unfinished_requests()
                self._forget(parent)
        return unfinished

    def process(self, step: CoreStep) -> list[RequestOutput | PoolingRequestOutput]:
        """The outputs of the user requests that progressed in the step (or failed before running)."""
        runner_output = step.runner_output
        if runner_output is not None and runner_output.prompt_logprobs:
            self._store_prompt_logprobs(runner_output.prompt_logprobs)
        outputs = self._process_tokens(step.sampled, runner_output, step.failed)
        if runner_output is not None and runner_output.pooler_output:
            outputs += self._pooled_outputs(runner_output.pooler_output)
        return outputs

    def _process_tokens(self, sampled: list[tuple[Request, int]], runner_output: ModelRunnerOutput | None,
                        failed: list[Request]) -> list[RequestOutput]:
        """Detokenizes the appended tokens, applies stop strings, and makes the user requests' outputs."""
        progressed: dict[str, ParentRequest | BeamSearchParent] = {}
        for request in failed:
            parent_id = self.parent_of[request.request_id]
            progressed[parent_id] = self.parents[parent_id]
        ended_here: set[str] = set()   # finished by a stop string or an error at a token of this step
        for request, row in sampled:
            if request.request_id in ended_here:
                # A speculative step gave it more tokens than it keeps: drop those after the end.
                request.all_token_ids.pop()
                request.cumulative_logprob -= runner_output.logprobs[row]
                continue
            try:
                if self._process_token(request, runner_output, row):
                    ended_here.add(request.request_id)
            except Exception as exc:  # one request's failure must not take the batch down
                logger.exception("request %s failed", request.request_id)
                request.error = f"{type(exc).__name__}: {exc}"
                self.finish(request, RequestStatus.FINISHED_ERROR)
                ended_here.add(request.request_id)
            parent_id = self.parent_of[request.request_id]
            progressed[parent_id] = self.parents[parent_id]
        for parent in [parent for parent in self.beam_searches if parent.finished]:
            progressed[parent.request_id] = parent
        outputs = [output for parent in progressed.values() if (output := parent.make_output()) is not None]
        for parent in progressed.values():
            if parent.finished:
                self._forget(parent)
        return outputs

    def _process_token(self, request: Request, runner_output: ModelRunnerOutput, row: int) -> bool:
        """Takes in one appended token; True when it completed a stop string, which ends the request."""
        child = self.children[request.request_id]
        token_id = runner_output.sampled_token_ids[row]
        top = None
        if request.sampling_params.logprobs is not None:
            top = self._logprob_entry(token_id, runner_output.logprobs[row], runner_output.token_ranks[row],
                                      runner_output.top_logprob_ids[row], runner_output.top_logprobs[row],
                                      request.sampling_params.logprobs)
        stop_string = process_token(child, token_id, top)
        if stop_string is not None:   # ends the request even if max_tokens did in the same token
            request.stop_reason = stop_string
            self.finish(request, RequestStatus.FINISHED_STOPPED)
            return True
        return False

    def _store_prompt_logprobs(self, chunks: dict[str, PromptLogprobs]) -> None:
        """Hands each request's share of the step's prompt logprobs to its user request, as Logprob entries."""
        for request_id, chunk in chunks.items():
            parent = self.parents.get(self.parent_of.get(request_id))
            if parent is None:   # aborted since the step was scheduled
                continue
            positions = range(chunk.first_position, chunk.first_position + len(chunk.token_logprobs))
            entries = [self._logprob_entry(parent.prompt_token_ids[position], *values, parent.params.prompt_logprobs)
                       for position, *values in zip(positions, chunk.token_logprobs, chunk.token_ranks,
                                                    chunk.top_ids, chunk.top_logprobs)]
            parent.add_prompt_logprobs(chunk.first_position, entries)

    def _logprob_entry(self, token_id: int, token_logprob: float, rank: int, top_ids: list[int],
                       top_values: list[float], k: int) -> dict[int, Logprob]:
        """The token's logprob and rank, plus the k most likely tokens ranked from 1 (sampled or prompt tokens)."""
        decode = self.tokenizer.decode
        entry = {token_id: Logprob(token_logprob, rank, decode([token_id], skip_special_tokens=False))}
        for top_rank, (top_id, value) in enumerate(zip(top_ids[:k], top_values[:k]), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(value, top_rank, decode([top_id], skip_special_tokens=False))
        return entry

    def _pooled_outputs(self, pooled: dict) -> list[PoolingRequestOutput]:
        """The pooling requests the step finished (the scheduler freed their blocks), each with its result."""
        outputs = []
        for request_id, row in pooled.items():
            parent = self.parents.get(request_id)
            if parent is None:   # aborted since the step was scheduled
                continue
            parent.take(row)
            outputs.append(parent.make_output())
            self._forget(parent)
        return outputs

    def _forget(self, parent: ParentRequest | BeamSearchParent | PoolingParent) -> None:
        del self.parents[parent.request_id]
        if isinstance(parent, PoolingParent):
            return
        if isinstance(parent, BeamSearchParent):
            self.beam_searches.remove(parent)
            return
        for child in parent.children:
            del self.children[child.request.request_id]
            del self.parent_of[child.request.request_id]
