"""The scheduler's side of speculation: which decoding requests speculate in a step, and how many proposal
rows each gets (the token budget and the slots count them). Pure bookkeeping, no tensors."""
from __future__ import annotations

from pagedllm.engine.request import Request
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.spec_decode.ngram import propose_ngram


class SpeculationPlanner:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.disable_by_batch_size = config.disable_by_batch_size

    def enabled_for(self, num_running: int) -> bool:
        """Whether a step that starts with num_running requests speculates at all."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def plan(self, request: Request, budget: int) -> tuple[int, list[int] | None]:
        """(proposal rows, the proposals) for a request about to decode one token with `budget` tokens left
        in the step; the proposals are None when the worker's draft model makes them. Never proposes past
        max_tokens, so every accepted token is one the request may still emit."""
        if request.beam_search is not None:   # beams choose their tokens from top-k candidates instead
            return 0, None
        config = self.config
        room = min(config.num_speculative_tokens, request.max_tokens - request.num_output_tokens - 1, budget - 1)
        if room <= 0:
            return 0, None
        if config.method == "draft_model":
            return room, None
        proposals = propose_ngram(request.all_token_ids, config.prompt_lookup_min, config.prompt_lookup_max, room)
        return len(proposals), proposals
