"""The scheduler's max_loras, without a model: never more adapters among the running requests than there are slots,
and fcfs kept: a request whose adapter must wait for a slot is not overtaken by later ones."""
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv.manager import KVCacheManager
from pagedllm.lora.request import LoRARequest
from pagedllm.worker.model_free_runner import ModelFreeRunner
from tests.scheduling import EOS, MAX_MODEL_LEN, PLAIN, FakeModel, step


def lora_request(lora_id: int) -> LoRARequest | None:
    return LoRARequest(f"adapter-{lora_id}", lora_id, "/adapters") if lora_id else None


def run(adapters: list[int], max_loras: int, max_tokens: int = 3) -> list[tuple[set[int], list[str]]]:
    """Each step's adapters (of its running requests) and the requests it admitted, in order."""
    scheduler = Scheduler(KVCacheManager(64, 4), 8, 64, max_loras=max_loras)
    runner = ModelFreeRunner(MAX_MODEL_LEN, 4, FakeModel(None))
    for index, lora_id in enumerate(adapters):
        scheduler.add_request(Request(f"r{index}", [10 + index] * 5, PLAIN, (EOS,), max_tokens, arrival_time=index,
                                      lora_request=lora_request(lora_id)))
    steps = []
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, runner)
        running = {request.lora_request.lora_int_id for request in scheduler.running if request.lora_request}
        running |= {new.lora_request.lora_int_id for new in plan.scheduled_new_reqs if new.lora_request}
        steps.append((running, [new.request_id for new in plan.scheduled_new_reqs]))
        assert len(steps) < 200
    return steps


def test_one_slot_runs_the_adapters_in_arrival_order():
    steps = run([1, 2, 1, 0], max_loras=1)
    admitted = [request_id for _, new in steps for request_id in new]
    assert admitted == ["r0", "r1", "r2", "r3"]   # r2 (adapter 1, like r0) does not overtake r1 (adapter 2)
    assert steps[0][1] == ["r0"]                   # r1 waits for the slot, and r2, r3 behind it
    assert all(len(running) <= 1 for running, _ in steps)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=12), st.integers(1, 3))
def test_never_more_adapters_than_max_loras_and_every_request_finishes(adapters, max_loras):
    steps = run(adapters, max_loras)
    assert all(len(running) <= max_loras for running, _ in steps)
    admitted = [request_id for _, new in steps for request_id in new]
    assert sorted(admitted, key=lambda request_id: int(request_id[1:])) == admitted   # fcfs
    assert len(admitted) == len(adapters)
