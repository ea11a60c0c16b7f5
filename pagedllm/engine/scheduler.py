"""Owns the request lifecycle: decides, each step, which requests run and how many tokens each
computes, and applies what the step sampled.

One rule covers prefill and decode alike: a request is scheduled for the tokens
it has that have no KV yet (`num_tokens - num_computed_tokens`), cut to the
step's token budget, so a long prompt is prefilled in chunks while others keep
decoding (with `enable_chunked_prefill=False` a prompt waits until it fits whole).
Running requests go first. When one needs a block and none is free (idle
prefix-cache blocks are evicted first, by the pool), the lowest-priority,
latest-arrived running request is preempted: its blocks are freed and its tokens
recomputed later, so a full cache never fails a request.

A running request with nothing to compute waits for its siblings (beam search). When a
step would run nothing while requests wait, those requests hold the blocks that
waiting ones (often their own siblings) need: they are preempted and parked, that is, not
admitted again until they have a new token to compute, so the blocks go to requests that
can move their search on.

`schedule()` hands the step to the workers as plain data (pagedllm/step.py, written by engine/step_data.py):
a request they do not hold comes whole, a running one as what it gained since its last step.
`update_from_output()` applies the result in one place: computed tokens advanced, full blocks cached,
sampled tokens appended and checked against the token-level stops (EOS, stop_token_ids, max_tokens),
beams advanced, finished requests freed. Stop strings need text, so the output processor checks them and calls `finish`.

Structured outputs: a request with a grammar (`Request.grammar`) is admitted only once its grammar has
compiled (others run meanwhile); each step carries the bitmask of the rows that sample under a grammar
(filled by the `structured_output` manager the engine passes in), and `update_from_output` advances
their matchers. With no such request, none of this runs.

A request with cache pins (Anthropic's cache_control) pins those prefixes of its prompt once the prompt is
computed; pins expire at the start of a step. A waiting request that cannot get its blocks while nothing runs
(so nothing would ever free them) drops pins, the nearest deadline first, rather than wait for them.

With speculation, a decoding request may take 1 + k rows and keeps the KV of the tokens it accepted only
(engine/spec_scheduling.py). The stops a sampled token decides are engine/stop_checks.py's.

With a KV disk tier, a waiting request whose cached prefix continues on disk waits one step while those
blocks are read back (the step's `disk_work`), then is admitted with them as prefix-cache hits.

Preemption by swap (a PreemptionPolicy that chooses it, and room in the KV manager's swap space): the victim's
computed blocks are copied out instead of dropped and it keeps its num_computed_tokens; when its turn comes it
waits one step while they are copied back into fresh blocks, then runs on from where it stopped.
"""
from __future__ import annotations

import bisect

from pagedllm.engine.preemption import PreemptionPolicy
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.spec_scheduling import SpecScheduling
from pagedllm.engine.step_data import describe_scheduled, is_plain_decode, new_request_data
from pagedllm.engine.stop_checks import check_stop
from pagedllm.kv.manager import KVCacheManager
from pagedllm.spec_decode.planner import SpeculationPlanner
from pagedllm.step import ModelRunnerOutput, SchedulerOutput


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", structured_output=None,
                 speculation: SpeculationPlanner | None = None, max_loras: int | None = None,
                 preemption: PreemptionPolicy | None = None):
        """max_loras: the most adapters the running requests may use at once (a step's LoRA slots); None: LoRA off.
        preemption: how preempted requests give back their blocks (None: recompute)."""
        self.kv_manager = kv_manager
        self.max_loras = max_loras
        self.preemption = preemption
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.requests: dict[str, Request] = {}   # every unfinished request the scheduler holds
        # Both kept sorted by _order_key, so the back of `running` is always the one to preempt.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._parked: dict[str, int] = {}   # request id -> its length when parked (see the module docstring)
        # First sample's id -> its parallel siblings, forked from it in the step where it first samples.
        self._pending_forks: dict[str, list[Request]] = {}
        self._finished_ids: list[str] = []   # finished since the last step: the workers forget them
        self.structured_output = structured_output   # a StructuredOutputManager, or None
        self._num_grammar_requests = 0   # of self.requests
        self.failed_requests: list[Request] = []   # failed before running (grammar did not compile)
        self.speculation = SpecScheduling(speculation, kv_manager) if speculation is not None else None
        self.spec_decoding_stats = self.speculation.stats if speculation is not None else None

    def _order_key(self, request: Request) -> tuple:
        if self.policy == "priority":
            return request.priority, request.arrival_time
        return (request.arrival_time,)

    def add_request(self, request: Request, siblings: list[Request] = ()) -> None:
        """Queues a request; `siblings` (the other parallel samples of its prompt) are forked from it
        when it first samples, sharing its prefill and every block."""
        self._hold(request)
        self._enqueue(request)
        if siblings:
            self._pending_forks[request.request_id] = list(siblings)

    def _hold(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._num_grammar_requests += request.grammar is not None

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self._order_key)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        self.kv_manager.expire_pins()
        scheduled: list[tuple[Request, int]] = []
        budget = self.max_num_batched_tokens
        running, add = self.running, scheduled.append
        allocate = self.kv_manager.allocate_slots
        speculates = self.speculation is not None and self.speculation.enabled_for(len(running))
        # A plain decode is written into the step here, in the same pass (describe_scheduled's rule for it, which
        # then sees the other requests only); not while parallel samples wait to fork, as forks follow their
        # first sample in the step's order.
        writes_decodes = not self._pending_forks
        num_scheduled, cached, table_of = out.num_scheduled_tokens, out.scheduled_cached_reqs, self.kv_manager.get_block_table
        add_decode_id, add_decode_token = cached.decode_request_ids.append, cached.decode_token_ids.append
        rewritten = self.kv_manager.rewritten_entries()
        index = 0
        while index < len(running) and budget > 0:   # the hot loop (bench scheduling)
            request = running[index]
            computed = request.num_computed_tokens
            tokens = request.all_token_ids
            num_new = len(tokens) - computed
            if num_new == 0:  # waits for siblings (beam search) before it gets a new token
                index += 1
                continue
            # A request under a grammar does not speculate: its bitmask covers one row per step.
            if num_new == 1 and speculates and request.grammar is None and self.speculation.schedule_proposals(
                    request, budget, out):
                num_new += out.num_spec_tokens[request.request_id]
            elif num_new > budget:
                num_new = budget
            request_id = request.request_id
            if not allocate(request_id, computed + num_new, computed) and not self._preempt_until_fits(
                    request, num_new, out):
                break
            budget -= num_new
            index += 1
            if not writes_decodes:
                add((request, num_new))
                continue
            num_scheduled[request_id] = num_new   # here, so that the step keeps the running order
            if num_new == 1 and is_plain_decode(request, len(tokens), len(table_of(request_id)), rewritten):
                add_decode_id(request_id)
                add_decode_token(tokens[-1])
                request.worker_num_tokens = computed + 1
            else:
                add((request, num_new))
        if not out.preempted_req_ids:
            self._admit_waiting(budget, scheduled)
        if not scheduled and not num_scheduled and self.waiting:   # also when the only request with work preempted itself
            self._park_idle_for_waiting(budget, scheduled, out)
        describe_scheduled(scheduled, out, self.kv_manager, self._fork_siblings if self._pending_forks else None)
        if self._num_grammar_requests:
            self._fill_grammar_bitmask(out)
        return out

    def _fill_grammar_bitmask(self, out: SchedulerOutput) -> None:
        """The bitmask of the rows that sample in this step under a grammar (their KV reaches their last token)."""
        requests = self.requests
        constrained = [request for request_id, num_new in out.num_scheduled_tokens.items()
                       if (request := requests[request_id]).grammar is not None
                       and request.num_computed_tokens + num_new == request.num_tokens]
        if constrained:
            out.grammar_request_ids = [request.request_id for request in constrained]
            out.grammar_bitmask = self.structured_output.grammar_bitmask([r.grammar for r in constrained])

    def _fork_siblings(self, first: Request, num_new: int, out: SchedulerOutput) -> None:
        """The first sample of n finishes its prefill in this step: its siblings take every block it holds
        now and sample from its logits row, so they join the step computing nothing."""
        siblings = self._pending_forks.pop(first.request_id, None)
        if siblings is None:
            return
        table = self.kv_manager.get_block_table(first.request_id)
        for sibling in siblings:
            self.kv_manager.fork(first.request_id, sibling.request_id)
            sibling.all_token_ids = list(first.all_token_ids)
            sibling.num_computed_tokens = first.num_computed_tokens + num_new
            self._admit_running(sibling)
            out.scheduled_new_reqs.append(new_request_data(sibling, table, sample_with=first.request_id))
            sibling.worker_num_tokens, sibling.worker_num_blocks = len(sibling.all_token_ids), len(table)
            out.num_scheduled_tokens[sibling.request_id] = 0

    def _admit_running(self, request: Request) -> None:
        """Admits a request whose KV is already in place (a fork of a running one)."""
        self._hold(request)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._order_key)

    def _park_idle_for_waiting(self, budget: int, scheduled: list[tuple[Request, int]],
                               out: SchedulerOutput) -> None:
        """Preempts and parks every running request that only waits for siblings, then admits waiting ones."""
        for request in [r for r in self.running if r.num_computed_tokens == r.num_tokens]:
            self.running.remove(request)
            self._parked[request.request_id] = request.num_tokens
            self._preempt(request, out)
        self._admit_waiting(budget, scheduled)

    def _next_to_admit(self) -> int | None:
        """Index in `waiting` of the first request with something to compute (a parked one has not, until
        its search takes a step and gives it a new token) whose grammar, if any, has compiled."""
        parked = self._parked
        for index, request in enumerate(self.waiting):
            if parked and parked.get(request.request_id) == request.num_tokens:
                continue
            if request.grammar is not None and not request.grammar.is_ready:
                continue
            if self.kv_manager.tiers.is_loading(request.request_id):
                continue
            return index
        return None

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> None:
        kv = self.kv_manager
        adapters = self._running_adapters() if self.max_loras is not None else None
        while budget > 0 and len(self.running) < self.max_num_seqs:
            index = self._next_to_admit()
            if index is None:
                break
            request = self.waiting[index]
            lora_id = request.lora_request.lora_int_id if request.lora_request is not None else None
            if lora_id is not None and lora_id not in adapters and len(adapters) >= self.max_loras:
                break   # its adapter needs a slot the running ones hold: it waits, and those behind it (fcfs)
            if request.grammar is not None and request.grammar.error is not None:
                request.error = request.grammar.error
                self.finish(request, RequestStatus.FINISHED_ERROR)
                self.failed_requests.append(request)
                continue
            if kv.tiers.is_swapped(request.request_id):
                if kv.tiers.swap_in(request.request_id, request.num_tokens) or (
                        not self.running and self._make_room_when_idle(request)):
                    continue   # admitted once its blocks are copied back
                break
            restored = kv.tiers.restored_tokens(request.request_id)
            if restored is not None:   # swapped back in: its KV is in place
                cached, num_computed = [], restored
            else:
                # Cached blocks carry no logits: a request asking for prompt logprobs recomputes its prefix.
                cached = [] if request.sampling_params.prompt_logprobs is not None else kv.get_computed_blocks(
                    request.request_id, request.all_token_ids, request.cache_salt)
                if kv.load_from_disk(request.request_id, request.all_token_ids, cached):
                    continue   # admitted once the blocks are back from disk
                num_computed = len(cached) * kv.block_size
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not kv.allocate_slots(request.request_id, num_computed + num_new, num_computed, cached) and not (
                    not self.running and kv.drop_pins_for(num_new)
                    and kv.allocate_slots(request.request_id, num_computed + num_new, num_computed, cached)):
                if restored is not None and not self.running:
                    kv.free(request.request_id)   # nothing runs to free blocks for it: it recomputes instead
                    request.num_computed_tokens = 0
                    continue
                break
            self.waiting.pop(index)
            self._parked.pop(request.request_id, None)
            if restored is None:
                kv.record_prefix_lookup(request.num_tokens, num_computed)
                request.num_cached_tokens = num_computed
            kv.tiers.take_restored(request.request_id)
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._order_key)
            scheduled.append((request, num_new))
            budget -= num_new
            if lora_id is not None:
                adapters.add(lora_id)

    def _running_adapters(self) -> set[int]:
        return {request.lora_request.lora_int_id for request in self.running if request.lora_request is not None}

    def _make_room_when_idle(self, request: Request) -> bool:
        """Nothing runs, so nothing will free blocks for a swapped-out request: pins go, then the blocks that
        other waiting requests got back by swapping (they recompute). Whether it could start its swap-in."""
        kv = self.kv_manager
        kv.drop_pins_for(request.num_tokens)
        for other in self.waiting:
            if other is not request and kv.tiers.restored_tokens(other.request_id) is not None:
                kv.free(other.request_id)
                other.num_computed_tokens = 0
        return kv.tiers.swap_in(request.request_id, request.num_tokens)

    def _preempt_until_fits(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Preempts the least important running requests until `request` gets its blocks;
        False when it had to be preempted itself."""
        kv = self.kv_manager
        while True:
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
            if kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new,
                                 request.num_computed_tokens):
                return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if self.preemption is None or not self.preemption.swap_out(self.kv_manager, request.request_id,
                                                                   request.num_computed_tokens):
            self.kv_manager.free(request.request_id)
            request.num_computed_tokens = 0
        if request.worker_num_tokens:
            out.preempted_req_ids.append(request.request_id)
            request.worker_num_tokens = request.worker_num_blocks = 0
        self.num_preemptions += 1
        self._enqueue(request)
        request.status = RequestStatus.PREEMPTED

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
                           ) -> list[tuple[Request, int]]:
        """Applies a finished step: advances computed tokens, caches the blocks that became full, appends
        each sampled token and checks the token-level stops, moves beam searches on, frees what finished.

        Returns (request, row in runner_output) for every plain request that got a token, in row order.
        """
        requests, kv = self.requests, self.kv_manager
        if scheduler_output.disk_work is not None:   # (a swap-in may have found every block in RAM: no copies)
            kv.complete_disk_loads(runner_output.kv_load_failures)
        cache_full_blocks, block_size = kv.cache_full_blocks, kv.block_size
        speculated = scheduler_output.num_spec_tokens
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            if speculated and request_id in speculated:   # advanced by the tokens it accepts, below
                continue
            request = requests[request_id]
            request.num_computed_tokens = computed = request.num_computed_tokens + num_new
            if num_new > 1 or computed % block_size == 0:   # a decode fills a block only at a block boundary
                cache_full_blocks(request_id, request.all_token_ids, computed)
            if request.cache_pins and computed - num_new < request.num_prompt_tokens <= computed:
                self._pin_prefixes(request)
        sampled = []
        add_sampled = sampled.append
        searches = []
        logprobs = runner_output.logprobs
        get_request = requests.get
        for row, (request_id, token_id) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            request = get_request(request_id)
            if request is None:   # a token stop ended it at an earlier row of this step (speculation)
                continue
            search = request.beam_search
            if search is not None:
                search.add_candidates(request, runner_output.top_logprob_ids[row], runner_output.top_logprobs[row])
                if search not in searches:
                    searches.append(search)
                continue
            tokens = request.all_token_ids
            tokens.append(token_id)
            request.cumulative_logprob += logprobs[row]
            add_sampled((request, row))
            # Most tokens can stop nothing: the full check runs only where one could (Request.stop_check_ids).
            if token_id in request.stop_check_ids or len(tokens) >= request.stop_check_length or request.grammar is not None:
                status = check_stop(request, token_id)
                if status is not None:
                    self.finish(request, status)
        for search in searches:
            search.advance_if_ready(self)
        for request_id in runner_output.pooler_output or ():   # pooled: done, and its blocks are freed now
            self.finish(requests[request_id], RequestStatus.FINISHED_STOPPED)
        if speculated:
            self.speculation.keep_verified(requests, scheduler_output, runner_output)
        return sampled

    def _pin_prefixes(self, request: Request) -> None:
        """Once its prompt is computed (every full block cached), the request pins the prefixes it asked for."""
        pin_prefix = self.kv_manager.pin_prefix
        request.num_pinned_tokens = max(pin_prefix(request.request_id, request.all_token_ids, pin.num_tokens, pin.ttl_s)
                                        for pin in request.cache_pins)

    def fork(self, source: Request, target: Request) -> None:
        """Starts `target` from `source`'s tokens. A running source shares its KV with it (every block, copy on
        write); a preempted one has none to share, so the target waits to compute its tokens, as the source does."""
        target.all_token_ids = list(source.all_token_ids)
        if source.status is RequestStatus.RUNNING:
            target.num_computed_tokens = source.num_computed_tokens
            self.kv_manager.fork(source.request_id, target.request_id)
            self._admit_running(target)
        else:
            self.add_request(target)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Takes a request out of the queues and frees its blocks at once."""
        request.status = status
        request_id = request.request_id
        if self.requests.pop(request_id, None) is None:
            return   # finished already, or never queued (a parallel sample that was never forked)
        if request.grammar is not None:
            self._num_grammar_requests -= 1
            request.grammar = None   # frees its matcher
        self._parked.pop(request_id, None)
        self._pending_forks.pop(request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_manager.free(request_id)
        self._finished_ids.append(request_id)

