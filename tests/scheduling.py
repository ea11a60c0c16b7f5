"""The model-free harness the scheduler and KV tests share: a fake model that plays the runner's sampler, one
scheduler step checked against the worker's persistent batch, and a new request's prefix lookup and slots."""
from __future__ import annotations

from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.model_free_runner import ModelFreeRunner

EOS = 2
PLAIN = SamplingParams(temperature=0)
MAX_MODEL_LEN = 256


class FakeModel:
    """Plays the model: the token each sampling row gets comes from `next_token(request_id, length)`
    (default: counting up from 100), beams get random-free candidates, so runs are exact."""

    def __init__(self, next_token=None):
        self.next_token = next_token or (lambda request_id, length: 100 + length)

    def __call__(self, batch, rows, num_new, sampling_rows) -> ModelRunnerOutput:
        req_ids = [batch.req_ids[row] for row in sampling_rows.tolist()]
        tokens = [self.next_token(request_id, int(batch.num_tokens[row]))
                  for request_id, row in zip(req_ids, sampling_rows.tolist())]
        candidates = [[token, token + 1, token + 2, token + 3] for token in tokens]
        values = [[-0.1, -0.2, -0.3, -0.4] for _ in tokens]
        return ModelRunnerOutput(req_ids, tokens, [-0.5] * len(tokens), candidates, values)


def step(scheduler: Scheduler, runner: ModelFreeRunner) -> tuple[SchedulerOutput, list[tuple[Request, int]]]:
    plan = scheduler.schedule()
    output = runner.execute_model(plan)
    assert_batch_mirrors_scheduler(scheduler, runner, plan)
    return plan, scheduler.update_from_output(plan, output)


def assert_batch_mirrors_scheduler(scheduler: Scheduler, runner: ModelFreeRunner, plan: SchedulerOutput) -> None:
    """After the runner applied a step: it holds exactly the running requests the scheduler sent, each with
    the scheduler's tokens, computed count and block table."""
    batch = runner.input_batch
    sent = {r.request_id for r in scheduler.running if r.worker_num_tokens}
    assert set(batch.req_ids) == sent and len(batch.req_ids) == len(sent)
    for request_id in plan.num_scheduled_tokens:
        req = scheduler.requests[request_id]
        row = batch.row_of[request_id]
        assert batch.token_ids[row, :batch.num_tokens[row]].tolist() == req.all_token_ids
        assert batch.num_computed_tokens[row] == req.num_computed_tokens
        assert batch.block_table[row, :batch.num_blocks[row]].tolist() == scheduler.kv_manager.get_block_table(
            request_id)


def new_request(manager, request_id, token_ids, cache_salt=None):
    """What the scheduler does for a new request: prefix lookup, then slots for all tokens."""
    cached = manager.get_computed_blocks(request_id, token_ids, cache_salt)
    num_computed = len(cached) * manager.block_size
    if not manager.allocate_slots(request_id, len(token_ids), num_computed, cached):
        return None
    manager.record_prefix_lookup(len(token_ids), num_computed)
    return num_computed
