"""The scheduler's speculative rows: with a SpeculationPlanner, a decoding request may take 1 + k rows (its
next token and k proposals), all counted in the token budget and given slots. After the step it keeps the KV
of the tokens it accepted only: `KVCacheManager.rollback` gives back the rejected slots, and blocks are
cached up to the verified tokens. Speculation never preempts anyone: a request whose proposal rows find no
free block decodes one token."""
from __future__ import annotations

from pagedllm.engine.request import Request
from pagedllm.kv.manager import KVCacheManager
from pagedllm.spec_decode.metrics import SpecDecodingStats
from pagedllm.spec_decode.planner import SpeculationPlanner
from pagedllm.step import ModelRunnerOutput, SchedulerOutput


class SpecScheduling:
    def __init__(self, planner: SpeculationPlanner, kv_manager: KVCacheManager):
        self.planner = planner
        self.kv_manager = kv_manager
        self.stats = SpecDecodingStats(planner.config.num_speculative_tokens)

    def enabled_for(self, num_running: int) -> bool:
        return self.planner.enabled_for(num_running)

    def schedule_proposals(self, request: Request, budget: int, out: SchedulerOutput) -> bool:
        """Plans the request's proposal rows and takes their slots; False (nothing changed) when it gets
        none, or the pool has no free block for them."""
        if request.beam_search is not None:   # beams choose their tokens from top-k candidates instead
            return False
        room = min(request.max_tokens - request.num_output_tokens - 1, budget - 1)
        num_spec, proposals = self.planner.plan(request.all_token_ids, room)
        computed = request.num_computed_tokens
        if not num_spec or not self.kv_manager.allocate_slots(request.request_id, computed + 1 + num_spec, computed):
            return False
        out.num_spec_tokens[request.request_id] = num_spec
        if proposals is not None:
            out.spec_token_ids[request.request_id] = proposals
        return True

    def keep_verified(self, requests: dict[str, Request], scheduler_output: SchedulerOutput,
                      runner_output: ModelRunnerOutput) -> None:
        """After a speculative step: each request's KV now holds its decode token and the proposals it
        accepted (one row each but the last, the target's own token, which has no KV yet); the slots of
        rejected proposals go back, and blocks that became full and verified are cached."""
        num_rows: dict[str, int] = {}
        for request_id in runner_output.req_ids:
            num_rows[request_id] = num_rows.get(request_id, 0) + 1
        kv = self.kv_manager
        for request_id, num_spec in scheduler_output.num_spec_tokens.items():
            num_accepted = num_rows[request_id] - 1
            self.stats.observe(num_spec, num_accepted)
            request = requests.get(request_id)
            if request is None:   # finished in this step
                continue
            request.num_computed_tokens += 1 + num_accepted
            kv.rollback(request_id, request.num_computed_tokens)
            kv.cache_full_blocks(request_id, request.all_token_ids, request.num_computed_tokens)
