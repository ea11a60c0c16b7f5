"""The scheduler's side of speculation: which decoding requests speculate in a step, and how many proposal
rows each gets (the token budget and the slots count them). Pure bookkeeping over token lists, no tensors."""
from __future__ import annotations

from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.spec_decode.ngram import propose_ngram


class SpeculationPlanner:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.disable_by_batch_size = config.disable_by_batch_size

    def enabled_for(self, num_running: int) -> bool:
        """Whether a step that starts with num_running requests speculates at all."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def plan(self, token_ids: list[int], max_proposals: int) -> tuple[int, list[int] | None]:
        """(proposal rows, the proposals) for a sequence about to decode one token, given the most proposals
        the scheduler can take (bounded by the tokens the request may still emit and the step's budget, so
        every accepted token is one it may keep); the proposals are None when the worker's draft model
        makes them."""
        config = self.config
        room = min(config.num_speculative_tokens, max_proposals)
        if room <= 0:
            return 0, None
        if config.method == "draft_model":
            return room, None
        proposals = propose_ngram(token_ids, config.prompt_lookup_min, config.prompt_lookup_max, room)
        return len(proposals), proposals
