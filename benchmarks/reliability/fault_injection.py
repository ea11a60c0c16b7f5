"""The fault-injection server: `python -m benchmarks.reliability.fault_injection serve ...` is `pagedllm serve`
with faults that marked prompts set off inside the engine. It reaches the engine through its seams only:
LLMEngine's `wrap_executor`, and EngineCore's request listeners, step listeners and step gates. Nothing is
patched (tests/test_no_patching.py checks it).

- A prompt containing REQUEST_FAULT gets a corrupt sampled token (CORRUPT_TOKEN, no token id) from the
  executor, which the engine's per-request output path fails on: that request alone must fail, the rest of
  its batch carries on.
- A prompt containing STEP_FAULT makes the executor raise in the step that holds it: every request in flight
  fails with an error, and the engine must keep serving the requests that come after.
- A prompt containing HOLD_FAULT (one at a time, longer than one step's token budget) holds the engine
  part-way through its prefill, so a scenario can act at that point however fast the machine is. GET
  HOLDS_ROUTE tells when the hold starts, how it ended, and how many requests arrived during holds; POST
  RELEASE_ROUTE ends the hold and lets the held request run on to its end.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time

from benchmarks.reliability.fault_markers import (HOLD_FAULT, HOLD_TIMEOUT, HOLDS_ROUTE, RELEASE_ROUTE,
                                                  REQUEST_FAULT, STEP_FAULT)
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.executor.abstract import Executor
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.entrypoints import cli
from pagedllm.entrypoints.api_server import build_app, serve_app
from pagedllm.step import ModelRunnerOutput, SchedulerOutput

HOLD_POLL = 0.05      # seconds a held engine idles per skipped step, so it does not spin
CORRUPT_TOKEN = -1    # what a REQUEST_FAULT request samples: no tokenizer can turn it into text


class InjectedFault(RuntimeError):
    """Raised by the fault-injecting executor; its message names the fault."""


class Holds:
    """HOLD_FAULT requests, each held once, right after the step that computed the first part of its prompt.

    While one is held the engine skips its steps (its step gate stays shut), yet the calls queued on its
    thread between steps still run: /metrics answers (showing the request running, its blocks in use) and
    aborts go through. The hold ends when its request is aborted (its client left: counted as `left`), when
    RELEASE_ROUTE is posted (`released`: the request carries on) or after HOLD_TIMEOUT (`timed_out`).
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

    def gate(self) -> bool:
        """The engine core's step gate: shut (after a short idle, so the engine does not spin) while a request
        is held; ends the hold when its request was aborted, release was asked for, or time is up."""
        if self.held is None:
            return True
        if self.held.status == RequestStatus.FINISHED_ABORTED:
            self.left += 1
        elif self.release_requested:
            self.released += 1
        elif time.monotonic() > self.release_at:
            self.timed_out += 1
        else:
            time.sleep(HOLD_POLL)
            return False
        self.held, self.release_requested = None, False
        return True

    def after_step(self, _stats=None) -> None:
        """A step listener: starts holding a marked request whose prefill has begun and not ended."""
        for request in list(self.pending):
            if request.is_finished or request.num_computed_tokens >= request.num_prompt_tokens:
                self.pending.remove(request)
                self.missed += 1
            elif request.num_computed_tokens > 0 and self.held is None:
                self.pending.remove(request)
                self.held, self.release_at = request, time.monotonic() + HOLD_TIMEOUT


class FaultInjector:
    """Reads the markers of each request the engine queues and sets its fault off: `wrap` is LLMEngine's
    wrap_executor, `attach` joins the built engine's core."""

    def __init__(self):
        self.request_faults: set[str] = set()   # request ids: the executor sees plain step data
        self.step_faults: set[str] = set()
        self.holds = Holds()
        self.tokenizer = None

    def wrap(self, executor: Executor) -> Executor:
        return FaultInjectingExecutor(executor, self)

    def attach(self, engine: LLMEngine) -> None:
        self.tokenizer = engine.tokenizer
        engine.core.request_listeners.append(self.on_request)
        engine.core.step_listeners.append(self.holds.after_step)
        engine.core.step_gates.append(self.holds.gate)

    def on_request(self, request: Request, siblings: list[Request]) -> None:
        """A request listener: marks the request (with its parallel samples) by the markers in its prompt."""
        self.holds.arrived += self.holds.held is not None
        prompt = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        ids = {request.request_id, *(sibling.request_id for sibling in siblings)}
        if REQUEST_FAULT in prompt:
            self.request_faults |= ids
        if STEP_FAULT in prompt:
            self.step_faults |= ids
        if HOLD_FAULT in prompt:
            self.holds.pending.append(request)   # the first request runs the prefill


class FaultInjectingExecutor(Executor):
    """The engine's own executor, wrapped: a step holding a STEP_FAULT request raises before it runs, and a
    REQUEST_FAULT request's sampled token is replaced by CORRUPT_TOKEN."""

    def __init__(self, inner: Executor, faults: FaultInjector):
        self.inner = inner
        self.faults = faults
        self.driver_worker = inner.driver_worker

    def collective_rpc(self, method: str, *args, **kwargs):
        return self.inner.collective_rpc(method, *args, **kwargs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        faults = self.faults
        failing = faults.step_faults.intersection(scheduler_output.num_scheduled_tokens)
        if failing:
            faults.step_faults -= failing   # the failed step aborts them
            raise InjectedFault("injected step fault")
        output = self.inner.execute_model(scheduler_output)
        corrupt = faults.request_faults.intersection(output.req_ids)
        if not corrupt:
            return output
        faults.request_faults -= corrupt
        tokens = [CORRUPT_TOKEN if request_id in corrupt else token
                  for request_id, token in zip(output.req_ids, output.sampled_token_ids)]
        return dataclasses.replace(output, sampled_token_ids=tokens)

    def check_health(self) -> None:
        self.inner.check_health()

    def shutdown(self) -> None:
        self.inner.shutdown()


def main(argv: list[str]) -> None:
    """`serve` and its flags, as `pagedllm serve` takes them; one engine in this process."""
    args = cli.parse_args(argv)
    if args.command != "serve":
        raise SystemExit(f"the fault-injection launcher runs `serve` only, got {args.command!r}")
    engine_config, server_config = args.engine_config, args.server_config
    if engine_config.distributed_executor_backend == "ray":
        raise SystemExit("the fault-injection launcher runs one engine in its process: distributed_executor_backend "
                         "must not be ray")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    injector = FaultInjector()
    engine = LLMEngine(engine_config, wrap_executor=injector.wrap)
    injector.attach(engine)
    llm = AsyncLLM(engine, server_config.max_waiting_requests)
    app = build_app(llm, server_config)
    app.add_api_route(HOLDS_ROUTE, injector.holds.counts, methods=["GET"], include_in_schema=False)
    app.add_api_route(RELEASE_ROUTE, injector.holds.release, methods=["POST"], include_in_schema=False)
    serve_app(app, llm, server_config)


if __name__ == "__main__":
    main(sys.argv[1:])
