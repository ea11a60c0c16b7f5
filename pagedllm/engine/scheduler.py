"""Decides, each step, which requests run and how many tokens each computes.

One rule covers prefill and decode alike: a request is scheduled for the tokens
it has that have no KV yet (`num_tokens - num_computed_tokens`), cut to the
step's token budget, so a long prompt is prefilled in chunks while others keep
decoding. Running requests go first; when one needs a block and none is free,
the most recently arrived running request is preempted (its blocks freed, its
tokens recomputed later), so the cache filling up never fails a request.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.engine.request import Request, RequestStatus
from pagedllm.kv.manager import KVCacheManager


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]

    @property
    def samples(self) -> bool:
        """A row samples when this step brings its KV up to the end of the sequence."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, num_new, out):
                break
            budget -= num_new
            index += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv_manager.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(
                request, num_new, self.kv_manager.get_block_table(request.request_id)))
            budget -= num_new
        return out

    def _reserve(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Gets blocks for a running request, preempting from the back until they fit."""
        while not self.kv_manager.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        out.scheduled.append(ScheduledRequest(
            request, num_new, self.kv_manager.get_block_table(request.request_id)))
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Takes a request out of the queues and frees its blocks at once."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_manager.free(request.request_id)
