"""From sampled tokens to user-facing outputs: detokenize, check stops, group parallel samples.

A user request with n > 1 (or best_of) runs as independent child requests that
share the prompt; this module keeps them together and reports them as one
RequestOutput.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ChildState:
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
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

    @property
    def finished(self) -> bool:
        return all(child.request.is_finished for child in self.children)

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
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                             error=error)


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
        logprobs=request.logprobs[start:] if wants_logprobs else None,
        finish_reason=status.value if finished else None,
        stop_reason=request.stop_reason,
    )


def append_token(child: ChildState, token_id: int, token_logprob: float,
                 top_logprobs: dict[int, Logprob] | None) -> RequestStatus | None:
    """Adds a sampled token; returns the finishing status if the request is now done.

    A token that ends the request (EOS or a stop_token_id) stays in token_ids but,
    as in vLLM, adds no text unless include_stop_str_in_output is set.
    """
    request = child.request
    params = request.sampling_params
    request.all_token_ids.append(token_id)
    request.cumulative_logprob += token_logprob
    if top_logprobs is not None:
        request.logprobs.append(top_logprobs)
    if request.num_output_tokens >= params.min_tokens:
        stops_on_eos = token_id in request.eos_token_ids and not params.ignore_eos
        if stops_on_eos or token_id in params.stop_token_ids:
            if params.include_stop_str_in_output:
                child.detokenizer.append([token_id])
            request.stop_reason = None if stops_on_eos else token_id
            return RequestStatus.FINISHED_STOPPED
    stop_string = child.detokenizer.append([token_id])
    if stop_string is not None:
        request.stop_reason = stop_string
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
