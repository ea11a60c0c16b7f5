"""Test hook: `python -m pagedllm.bench.reliability.fault_injection serve ...` is `pagedllm serve` with faults
that marked requests set off inside the engine. The engine itself has no fault switches; this module wraps
two of its functions before the server starts.

- A prompt containing REQUEST_FAULT fails while its sampled token is processed, in the engine's
  per-request path: that request alone must fail, the rest of its batch carries on.
- A prompt containing STEP_FAULT makes the model step that holds it raise: every request in flight
  fails with an error, and the engine must keep serving the requests that come after.
"""
from __future__ import annotations

import sys
import weakref

from pagedllm.engine import llm_engine
from pagedllm.entrypoints import cli
from pagedllm.model.runner import ModelRunner

REQUEST_FAULT = "<<inject-request-fault>>"
STEP_FAULT = "<<inject-step-fault>>"


class InjectedFault(RuntimeError):
    """Raised by the hooks; its message names which one."""


def install() -> None:
    """Wraps LLMEngine.add_request (to spot marked prompts), append_token and ModelRunner.execute."""
    request_faults: weakref.WeakSet = weakref.WeakSet()
    step_faults: weakref.WeakSet = weakref.WeakSet()
    add_request, append_token, execute = llm_engine.LLMEngine.add_request, llm_engine.append_token, ModelRunner.execute

    def marking_add_request(self, request_id, *args, **kwargs):
        add_request(self, request_id, *args, **kwargs)
        parent = self.parents[request_id]
        prompt = self.tokenizer.decode(parent.prompt_token_ids, skip_special_tokens=False)
        for marker, marked in ((REQUEST_FAULT, request_faults), (STEP_FAULT, step_faults)):
            if marker in prompt:
                marked.update(child.request for child in parent.children)

    def faulty_append_token(child, *args, **kwargs):
        if child.request in request_faults:
            raise InjectedFault(f"injected request fault in {child.request.request_id}")
        return append_token(child, *args, **kwargs)

    def faulty_execute(self, scheduled, *args, **kwargs):
        if any(row.request in step_faults for row in scheduled):
            raise InjectedFault("injected step fault")
        return execute(self, scheduled, *args, **kwargs)

    llm_engine.LLMEngine.add_request = marking_add_request
    llm_engine.append_token = faulty_append_token
    ModelRunner.execute = faulty_execute


if __name__ == "__main__":
    install()
    sys.exit(cli.main(sys.argv[1:]))
