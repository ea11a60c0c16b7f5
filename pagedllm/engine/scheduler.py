"""Decides, each step, which requests run and how many tokens each computes.

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
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.engine.request import Request, RequestStatus
from pagedllm.kv.manager import KVCacheManager

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]
    # Pending siblings (parallel samples) that take their first token from this row's logits; a shared
    # empty tuple unless there are some, as building a list per row per step showed in profiles.
    also_sample_for: Sequence[Request] = ()

    @property
    def samples(self) -> bool:
        """A row samples when this step brings its KV up to the end of the sequence."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs"):
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        # Both kept sorted by _order_key, so the back of `running` is always the one to preempt.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._parked: dict[str, int] = {}   # request id -> its length when parked (see the module docstring)

    def _order_key(self, request: Request) -> tuple:
        if self.policy == "priority":
            return request.priority, request.arrival_time
        return (request.arrival_time,)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self._order_key)

    def add_running(self, request: Request) -> None:
        """Admits a request whose KV is already in place (a fork of a running one)."""
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._order_key)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running, add = self.running, out.scheduled.append
        allocate, block_table = self.kv_manager.allocate_slots, self.kv_manager.get_block_table
        index = 0
        while index < len(running) and budget > 0:   # the hot loop: ~1 us per request (bench scheduling)
            request = running[index]
            request_id = request.request_id
            computed = request.num_computed_tokens
            num_new = len(request.all_token_ids) - computed
            if num_new == 0:  # waits for siblings (beam search) before it gets a new token
                index += 1
                continue
            if num_new > budget:
                num_new = budget
            if not allocate(request_id, computed + num_new, computed) and not self._preempt_until_fits(
                    request, num_new, out):
                break
            add(ScheduledRequest(request, num_new, block_table(request_id)))
            budget -= num_new
            index += 1
        if not out.preempted:
            self._admit_waiting(budget, out)
        if not out.scheduled and self.waiting:   # also when the only request with work preempted itself
            self._park_idle_for_waiting(budget, out)
        out.block_copies = self.kv_manager.take_block_copies()
        return out

    def _park_idle_for_waiting(self, budget: int, out: SchedulerOutput) -> None:
        """Preempts and parks every running request that only waits for siblings, then admits waiting ones."""
        for request in [r for r in self.running if r.num_computed_tokens == r.num_tokens]:
            self.running.remove(request)
            self._parked[request.request_id] = request.num_tokens
            self._preempt(request)
            out.preempted.append(request)
        self._admit_waiting(budget, out)

    def _next_to_admit(self) -> int | None:
        """Index in `waiting` of the first request with something to compute (a parked one has not, until
        its search takes a step and gives it a new token)."""
        if not self._parked:
            return 0 if self.waiting else None
        for index, request in enumerate(self.waiting):
            if self._parked.get(request.request_id) != request.num_tokens:
                return index
        return None

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        kv = self.kv_manager
        while budget > 0 and len(self.running) < self.max_num_seqs:
            index = self._next_to_admit()
            if index is None:
                break
            request = self.waiting[index]
            cached = kv.get_computed_blocks(request.request_id, request.all_token_ids, request.cache_salt)
            num_computed = len(cached) * kv.block_size
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not kv.allocate_slots(request.request_id, num_computed + num_new, num_computed, cached):
                break
            kv.record_prefix_lookup(request.num_tokens, num_computed)
            self.waiting.pop(index)
            self._parked.pop(request.request_id, None)
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._order_key)
            out.scheduled.append(ScheduledRequest(request, num_new, kv.get_block_table(request.request_id)))
            budget -= num_new

    def _preempt_until_fits(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Preempts the least important running requests until `request` gets its blocks;
        False when it had to be preempted itself."""
        kv = self.kv_manager
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
            if kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new,
                                 request.num_computed_tokens):
                return True

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request.request_id)
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self.add_request(request)
        request.status = RequestStatus.PREEMPTED

    def fork(self, source: Request, target: Request) -> None:
        """Starts `target` from `source`'s tokens. A running source shares its KV with it (every block, copy on
        write); a preempted one has none to share, so the target waits to compute its tokens, as the source does."""
        target.all_token_ids = list(source.all_token_ids)
        if source.status is RequestStatus.RUNNING:
            target.num_computed_tokens = source.num_computed_tokens
            self.kv_manager.fork(source.request_id, target.request_id)
            self.add_running(target)
        else:
            self.add_request(target)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Takes a request out of the queues and frees its blocks at once."""
        request.status = status
        self._parked.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_manager.free(request.request_id)
