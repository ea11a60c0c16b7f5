"""EngineCore's hooks for test tooling, on the model-free executor: a shut step gate skips the step (nothing
scheduled, nothing computed) while an abort between steps still goes through, and each request listener sees
every queued request with its siblings. The fault-injection server relies on exactly this instead of patching."""
from __future__ import annotations

from pagedllm.engine.core import EngineCore
from pagedllm.engine.executor.model_free_executor import ModelFreeExecutor
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.kv.manager import KVCacheManager
from pagedllm.worker.model_free_runner import ModelFreeRunner
from tests.scheduling import MAX_MODEL_LEN, PLAIN, FakeModel

BLOCK = 4


def _core() -> EngineCore:
    runner = ModelFreeRunner(MAX_MODEL_LEN, BLOCK, FakeModel())
    return EngineCore(ModelFreeExecutor(runner), KVCacheManager(num_blocks=16, block_size=BLOCK), max_num_seqs=4,
                      max_num_batched_tokens=8)


def _request(request_id: str, first_token: int = 1) -> Request:
    """12 prompt tokens from first_token on: more than one step's budget of 8."""
    return Request(request_id=request_id, prompt_token_ids=list(range(first_token, first_token + 12)),
                   sampling_params=PLAIN, eos_token_ids=(), max_tokens=4, arrival_time=0.0)


def test_a_shut_gate_skips_steps_and_aborts_still_go_through():
    core = _core()
    open_, asked = [True], []
    core.step_gates.append(lambda: asked.append(open_[0]) or open_[0])
    held, other = _request("held"), _request("other", first_token=50)   # no shared prefix
    core.add_request(held)
    first = core.step()   # 8 of 12 prompt tokens: part-way through the prefill
    assert first.runner_output is not None and held.num_computed_tokens == 8
    open_[0] = False
    core.add_request(other)
    for _ in range(3):
        skipped = core.step()
        assert skipped.runner_output is None and skipped.sampled == [] and skipped.failed == []
    assert held.num_computed_tokens == 8 and other.num_computed_tokens == 0 and asked == [True, False, False, False]
    assert core.kv_manager.get_block_table("held")   # still holding its blocks while the engine is held
    core.abort_requests([held])
    assert held.status is RequestStatus.FINISHED_ABORTED and "held" not in core.kv_manager.block_tables
    open_[0] = True
    assert core.step().runner_output is not None and other.num_computed_tokens == 8


def test_request_listeners_see_each_request_with_its_siblings():
    core = _core()
    seen = []
    core.request_listeners.append(lambda request, siblings: seen.append((request.request_id,
                                                                         [s.request_id for s in siblings])))
    core.add_request(_request("a"))
    core.add_request(_request("b"), [_request("b.1"), _request("b.2")])
    assert seen == [("a", []), ("b", ["b.1", "b.2"])]
    assert set(core.scheduler.requests) >= {"a", "b"}
