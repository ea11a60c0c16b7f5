"""The stops a sampled token id decides, checked by the scheduler as it appends the token (vLLM's
`check_stop`): EOS, stop_token_ids and max_tokens, and a structured-output grammar's end or refusal. Stop
strings need text, so the output processor checks those."""
from __future__ import annotations

from pagedllm.engine.request import Request, RequestStatus


def check_stop(request: Request, token_id: int) -> RequestStatus | None:
    """How the request finishes with `token_id` appended, or None while it goes on. A grammar always takes
    the token (its refusal is an error even where a token stop also holds)."""
    status = _token_stop(request, token_id)
    if request.grammar is not None:
        status = _grammar_stop(request, token_id) or status
    return status


def _grammar_stop(request: Request, token_id: int) -> RequestStatus | None:
    """Advances the request's grammar by the token: stopped once the grammar has taken its stop token (so
    nothing may follow, ignore_eos or not); an error if it refuses the token, which the bitmask should
    have made impossible."""
    grammar = request.grammar
    if not grammar.accept_tokens([token_id]):
        request.error = f"token {token_id} does not match the request's structured_outputs grammar"
        return RequestStatus.FINISHED_ERROR
    return RequestStatus.FINISHED_STOPPED if grammar.is_terminated else None


def _token_stop(request: Request, token_id: int) -> RequestStatus | None:
    """The stops a token id decides: EOS (unless ignore_eos) and stop_token_ids once min_tokens are out,
    then max_tokens. The token stays in the output; as in vLLM it adds no text unless
    include_stop_str_in_output."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        stops_on_eos = token_id in request.eos_token_ids and not params.ignore_eos
        if stops_on_eos or token_id in params.stop_token_ids:
            request.stop_reason = None if stops_on_eos else token_id
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
