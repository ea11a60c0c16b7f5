"""Test hook: `python -m pagedllm.bench.reliability.fault_injection serve ...` is `pagedllm serve` with faults
that marked requests set off inside the engine. The engine itself has no fault switches; this module wraps
some of its functions, and the app builder, before the server starts.

- A prompt containing REQUEST_FAULT fails while its sampled token is processed, in the engine's
  per-request path: that request alone must fail, the rest of its batch carries on.
- A prompt containing STEP_FAULT makes the model step that holds it raise: every request in flight
  fails with an error, and the engine must keep serving the requests that come after.
- A prompt containing HOLD_FAULT (one at a time, longer than one step's token budget) holds the engine
  part-way through its prefill, so a scenario can act at that point however fast the machine is. GET
  HOLDS_ROUTE tells when the hold starts, how it ended, and how many requests arrived during holds; POST
  RELEASE_ROUTE ends the hold and lets the held request run on to its end.
"""
from __future__ import annotations

import sys
import time
import weakref

from pagedllm.engine import llm_engine, output_processor
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.entrypoints import cli
from pagedllm.entrypoints import api_server
from pagedllm.worker.model_runner import ModelRunner

REQUEST_FAULT = "<<inject-request-fault>>"
STEP_FAULT = "<<inject-step-fault>>"
HOLD_FAULT = "<<inject-hold>>"
HOLDS_ROUTE = "/fault-injection/holds"
RELEASE_ROUTE = "/fault-injection/release"
HOLD_TIMEOUT = 60.0   # seconds: a hold nobody ends is released, and counted, so a broken scenario fails, not hangs
HOLD_POLL = 0.05      # seconds a held engine idles per skipped step, so it does not spin


class InjectedFault(RuntimeError):
    """Raised by the hooks; its message names which one."""


class Holds:
    """HOLD_FAULT requests, each held once, right after the step that computed the first part of its prompt.

    While one is held the engine skips its steps, yet the calls queued on its thread between steps still
    run: /metrics answers (showing the request running, its blocks in use) and aborts go through. The hold
    ends when its request is aborted (its client left: counted as `left`), when RELEASE_ROUTE is posted
    (`released`: the request carries on) or after HOLD_TIMEOUT (`timed_out`).
    A marked request whose prefill ends or that ends before it could be held counts as `missed`. Requests
    added while the engine is held count as `arrived`: none of them can run a step before the hold ends.
    """

    def __init__(self):
        self.pending: list[Request] = []
        self.held: Request | None = None
        self.release_at = 0.0
        self.release_requested = False
        self.left = self.timed_out = self.missed = self.arrived = self.released = 0

    def counts(self) -> dict[str, int]:
        return {"held": int(self.held is not None), "left": self.left, "timed_out": self.timed_out,
                "missed": self.missed, "arrived": self.arrived, "released": self.released}

    def release(self) -> dict[str, int]:
        """Ends the current hold, if any, at the engine's next turn (a flag: the engine thread owns `held`)."""
        self.release_requested = self.held is not None
        return self.counts()

    def holding(self) -> bool:
        """Whether the engine must skip this step; ends the hold when its request was aborted or time is up."""
        if self.held is None:
            return False
        if self.held.status == RequestStatus.FINISHED_ABORTED:
            self.left += 1
        elif self.release_requested:
            self.released += 1
        elif time.monotonic() > self.release_at:
            self.timed_out += 1
        else:
            return True
        self.held, self.release_requested = None, False
        return False

    def after_step(self) -> None:
        """Starts holding a marked request whose prefill has begun and not ended."""
        for request in list(self.pending):
            if request.is_finished or request.num_computed_tokens >= request.num_prompt_tokens:
                self.pending.remove(request)
                self.missed += 1
            elif request.num_computed_tokens > 0 and self.held is None:
                self.pending.remove(request)
                self.held, self.release_at = request, time.monotonic() + HOLD_TIMEOUT


def install() -> None:
    """Wraps LLMEngine.add_request (to spot marked prompts), process_token, ModelRunner.execute_model,
    LLMEngine.step and the server's build_app (to add HOLDS_ROUTE)."""
    request_faults: weakref.WeakSet = weakref.WeakSet()
    step_fault_ids: set[str] = set()   # the runner sees plain data: request ids
    holds = Holds()
    add_request, process_token = llm_engine.LLMEngine.add_request, output_processor.process_token
    execute_model = ModelRunner.execute_model
    step, build_app = llm_engine.LLMEngine.step, api_server.build_app

    def marking_add_request(self, request_id, *args, **kwargs):
        add_request(self, request_id, *args, **kwargs)
        holds.arrived += holds.held is not None
        parent = self.parents[request_id]
        prompt = self.tokenizer.decode(parent.prompt_token_ids, skip_special_tokens=False)
        if REQUEST_FAULT in prompt:
            request_faults.update(child.request for child in parent.children)
        if STEP_FAULT in prompt:
            step_fault_ids.update(child.request.request_id for child in parent.children)
        if HOLD_FAULT in prompt:
            holds.pending.append(parent.children[0].request)   # the first child runs the prefill

    def faulty_process_token(child, *args, **kwargs):
        if child.request in request_faults:
            raise InjectedFault(f"injected request fault in {child.request.request_id}")
        return process_token(child, *args, **kwargs)

    def faulty_execute_model(self, scheduler_output):
        faulty = step_fault_ids.intersection(scheduler_output.num_scheduled_tokens)
        if faulty:
            step_fault_ids.difference_update(faulty)   # the failed step aborts them
            raise InjectedFault("injected step fault")
        return execute_model(self, scheduler_output)

    def holding_step(self):
        if holds.holding():
            time.sleep(HOLD_POLL)
            return []
        outputs = step(self)
        holds.after_step()
        return outputs

    def build_app_with_holds_route(*args, **kwargs):
        app = build_app(*args, **kwargs)
        app.add_api_route(HOLDS_ROUTE, holds.counts, methods=["GET"], include_in_schema=False)
        app.add_api_route(RELEASE_ROUTE, holds.release, methods=["POST"], include_in_schema=False)
        return app

    llm_engine.LLMEngine.add_request = marking_add_request
    output_processor.process_token = faulty_process_token
    ModelRunner.execute_model = faulty_execute_model
    llm_engine.LLMEngine.step = holding_step
    api_server.build_app = build_app_with_holds_route


if __name__ == "__main__":
    install()
    sys.exit(cli.main(sys.argv[1:]))
