"""The scheduler without a model: the plain step data it hands over, and update_from_output on fake runner
outputs. Block counts are computed by hand; the worker side is the real InputBatch (ModelFreeRunner), which
must mirror the scheduler's requests and tables after every step."""
from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.engine.beam_search import BeamSearch, BeamSearchParams
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.step_data import describe_scheduled
from pagedllm.kv.manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.model_free_runner import ModelFreeRunner
from tests.scheduling import EOS, MAX_MODEL_LEN, PLAIN, FakeModel, step


def request(request_id: str, prompt_len: int, max_tokens: int = 8, params: SamplingParams = PLAIN,
            arrival: float = 0.0, first_token: int = 10) -> Request:
    return Request(request_id, list(range(first_token, first_token + prompt_len)), params, (EOS,), max_tokens,
                   arrival_time=arrival)


def engine(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
           next_token=None, **kwargs) -> tuple[Scheduler, ModelFreeRunner]:
    kv = KVCacheManager(num_blocks, block_size)
    return (Scheduler(kv, max_num_seqs, budget, **kwargs),
            ModelFreeRunner(MAX_MODEL_LEN, block_size, FakeModel(next_token)))


def run_until_done(scheduler: Scheduler, runner: ModelFreeRunner, limit: int = 1000) -> list[SchedulerOutput]:
    plans = []
    while scheduler.has_unfinished_requests():
        plans.append(step(scheduler, runner)[0])
        assert len(plans) < limit, "the scheduler made no progress"
    return plans


def test_a_request_arrives_whole_then_as_deltas_with_hand_computed_blocks():
    scheduler, runner = engine(block_size=4)
    scheduler.add_request(request("a", prompt_len=10, max_tokens=4))
    plan, sampled = step(scheduler, runner)
    (new,) = plan.scheduled_new_reqs
    assert new.token_ids == list(range(10, 20)) and new.num_computed_tokens == 0
    assert len(new.block_ids) == 3 and plan.num_scheduled_tokens == {"a": 10}   # ceil(10 / 4)
    assert [(r.request_id, row) for r, row in sampled] == [("a", 0)]
    # the fake model samples 100 + length; 11 and 12 tokens fit the third block, the 13th takes a fourth
    for computed, grows in ((10, False), (11, False), (12, True)):
        plan, _ = step(scheduler, runner)
        cached = plan.scheduled_cached_reqs
        assert plan.scheduled_new_reqs == []
        if grows:   # a new block: the general form, from the first entry the workers lack
            assert cached.request_ids == ["a"] and cached.decode_request_ids == []
            assert cached.new_token_ids == [[100 + computed]] and cached.num_computed_tokens == [computed]
            assert cached.block_table_starts == [3] and len(cached.new_block_ids[0]) == 1
        else:   # a plain decode: its id and its one token
            assert cached.decode_request_ids == ["a"] and cached.decode_token_ids == [100 + computed]
            assert cached.request_ids == []
    # that step sampled the 4th token: max_tokens reached
    assert not scheduler.has_unfinished_requests() and scheduler.kv_manager.pool.num_used_blocks == 0
    assert scheduler.schedule().finished_req_ids == ["a"]   # the workers hear of it with the next step


def test_chunked_prefill_keeps_a_decode_going_and_counts_the_budget():
    scheduler, runner = engine(budget=16, num_blocks=128)
    scheduler.add_request(request("short", prompt_len=5, max_tokens=50))
    step(scheduler, runner)
    scheduler.add_request(request("long", prompt_len=60, max_tokens=2, arrival=1.0))
    chunks = []
    while scheduler.requests["long"].num_output_tokens == 0:
        plan, sampled = step(scheduler, runner)
        assert plan.num_scheduled_tokens["short"] == 1 and [r.request_id for r, _ in sampled][0] == "short"
        chunks.append(plan.num_scheduled_tokens["long"])
        assert plan.total_num_scheduled_tokens <= 16
    # 60 prompt tokens, the first block of 4 a prefix-cache hit on "short"'s prompt: 56 at 15 a step beside the decode
    assert chunks == [15, 15, 15, 11]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    scheduler, runner = engine(budget=16, enable_chunked_prefill=False)
    scheduler.add_request(request("fits", prompt_len=10))
    scheduler.add_request(request("whole", prompt_len=12, arrival=1.0, first_token=50))
    plan, _ = step(scheduler, runner)
    assert plan.num_scheduled_tokens == {"fits": 10}
    plan, _ = step(scheduler, runner)
    assert plan.num_scheduled_tokens == {"fits": 1, "whole": 12}


def test_preemption_frees_the_latest_and_resends_it_whole():
    # 5 blocks of 4: two 8-token prompts take 4; growing to 9 tokens each needs 6 blocks in all.
    scheduler, runner = engine(num_blocks=5, block_size=4, max_num_seqs=4)
    scheduler.add_request(request("early", prompt_len=8, max_tokens=6))
    scheduler.add_request(request("late", prompt_len=8, max_tokens=6, arrival=1.0, first_token=50))
    step(scheduler, runner)
    plan, _ = step(scheduler, runner)
    assert plan.preempted_req_ids == ["late"] and plan.num_scheduled_tokens == {"early": 1}
    late = scheduler.requests["late"]
    assert late.status is RequestStatus.PREEMPTED and "late" not in scheduler.kv_manager.block_tables
    resent = None
    while resent is None:
        plan, _ = step(scheduler, runner)
        resent = next((new for new in plan.scheduled_new_reqs if new.request_id == "late"), None)
    # its prompt and the token it had sampled, recomputed from scratch (the step then sampled one more)
    assert resent.token_ids == late.all_token_ids[:9] and len(resent.token_ids) == 9
    # its first block was still in the prefix cache (its second, freed first, went to "early")
    assert resent.num_computed_tokens == 4
    run_until_done(scheduler, runner)
    assert scheduler.kv_manager.pool.num_used_blocks == 0 and scheduler.num_preemptions >= 1


def test_a_step_of_plain_decodes_that_preempts_admits_nobody():
    # 4 blocks of 4: "early" (6 tokens, 2 blocks) decodes in place, "late" (8 tokens, 2 blocks) needs a third block
    # and preempts itself. A request that waits (added after the first step, ahead of "late" by arrival) fits in
    # the freed blocks, but a step that preempted admits no one.
    scheduler, runner = engine(num_blocks=4, block_size=4, max_num_seqs=2)
    scheduler.add_request(request("early", prompt_len=6, max_tokens=6))
    scheduler.add_request(request("late", prompt_len=8, max_tokens=6, arrival=1.0, first_token=50))
    step(scheduler, runner)
    scheduler.add_request(request("waiter", prompt_len=3, max_tokens=2, arrival=0.5, first_token=80))
    plan, _ = step(scheduler, runner)
    assert plan.preempted_req_ids == ["late"] and plan.num_scheduled_tokens == {"early": 1}
    assert plan.scheduled_cached_reqs.decode_request_ids == ["early"] and plan.scheduled_new_reqs == []
    assert scheduler.requests["waiter"].status is RequestStatus.WAITING
    run_until_done(scheduler, runner)
    assert scheduler.kv_manager.pool.num_used_blocks == 0


def test_parallel_samples_fork_in_the_step_their_prefill_ends_and_copy_on_write():
    scheduler, runner = engine(block_size=4)
    first = request("0_p", prompt_len=6, params=SamplingParams(n=3))
    siblings = [request(f"{i}_p", prompt_len=6, params=SamplingParams(n=3)) for i in (1, 2)]
    scheduler.add_request(first, siblings)
    plan, sampled = step(scheduler, runner)
    forked = [new for new in plan.scheduled_new_reqs if new.sample_with is not None]
    assert [new.request_id for new in forked] == ["1_p", "2_p"] and {new.sample_with for new in forked} == {"0_p"}
    assert plan.num_scheduled_tokens == {"0_p": 6, "1_p": 0, "2_p": 0}
    assert [r.request_id for r, _ in sampled] == ["0_p", "1_p", "2_p"]   # one prefill, three first tokens
    kv = scheduler.kv_manager
    assert kv.get_block_table("1_p") == kv.get_block_table("0_p") and kv.usage().num_shared_blocks == 2
    plan, _ = step(scheduler, runner)   # each writes its 7th token into the shared, partly filled 2nd block
    assert len(plan.block_copies) == 2   # the first two writers copy; the last keeps the original
    cached = plan.scheduled_cached_reqs
    assert cached.block_table_starts == [1, 1]   # the two that copied: entry 1 replaced
    assert len(cached.decode_request_ids) == 1   # the last keeps its table: a plain decode


def test_a_decode_after_a_speculative_rollback_resends_the_entries_the_rollback_dropped():
    """A rollback gave back the block proposals had taken and the next step took another: the table is as long
    as the workers' but its last entry differs, so the step must not travel as a plain decode."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = request("a", prompt_len=8)
    assert kv.allocate_slots("a", 10, 7)   # its 8th token and two proposals: 3 blocks
    req.num_computed_tokens, req.worker_num_tokens, req.worker_num_blocks = 7, 8, 3
    kv.take_rewritten_entries()   # the step that sent those 3 entries
    req.num_computed_tokens = 8   # both proposals rejected: the KV keeps the 8th token only
    req.all_token_ids.append(50)   # the target's own token
    kv.rollback("a", 8)   # 2 blocks cover 8 tokens: the third goes back
    assert len(kv.get_block_table("a")) == 2
    assert kv.allocate_slots("a", 9, 8)   # the next step's decode takes a third block again
    out = SchedulerOutput()
    describe_scheduled([(req, 1)], out, kv)
    cached = out.scheduled_cached_reqs
    assert cached.decode_request_ids == [] and cached.request_ids == ["a"]
    assert cached.block_table_starts == [2] and cached.new_block_ids == [kv.get_block_table("a")[2:]]
    assert cached.new_token_ids == [[50]] and cached.num_computed_tokens == [8]


def test_token_stops_are_applied_in_update_from_output():
    stop_params = SamplingParams(temperature=0, stop_token_ids=[7], min_tokens=2)
    tokens = {"eos": [EOS], "stop": [7, 7], "ignore": [EOS, EOS, EOS], "length": [5, 5, 5]}
    scheduler, runner = engine(next_token=lambda request_id, length: tokens[request_id].pop(0))
    scheduler.add_request(request("eos", prompt_len=3))
    scheduler.add_request(request("stop", prompt_len=3, params=stop_params))
    scheduler.add_request(request("ignore", prompt_len=3, max_tokens=3,
                                  params=SamplingParams(temperature=0, ignore_eos=True)))
    scheduler.add_request(request("length", prompt_len=3, max_tokens=3))
    finished = {}
    while scheduler.has_unfinished_requests():
        for req, _ in step(scheduler, runner)[1]:
            if req.is_finished:
                finished[req.request_id] = (req.status, req.stop_reason, req.num_output_tokens)
    assert finished == {
        "eos": (RequestStatus.FINISHED_STOPPED, None, 1),
        "stop": (RequestStatus.FINISHED_STOPPED, 7, 2),   # the first 7 came before min_tokens
        "ignore": (RequestStatus.FINISHED_LENGTH, None, 3),
        "length": (RequestStatus.FINISHED_LENGTH, None, 3),
    }


def test_beam_search_runs_as_requests_and_frees_every_block():
    scheduler, runner = engine(block_size=4, num_blocks=64)
    search = BeamSearch("b", list(range(10, 17)), BeamSearchParams(beam_width=2, max_tokens=5), (EOS,), 5)
    scheduler.add_request(search.first_request)
    scheduler.add_request(request("plain", prompt_len=4, max_tokens=6))
    widths = []
    while not search.finished:
        step(scheduler, runner)
        widths.append(len(search.live))
        assert scheduler.has_unfinished_requests()
    assert max(widths) == 2 and len(search.best()) == 2
    assert all(len(sequence.output_token_ids) == 5 for sequence in search.best())
    run_until_done(scheduler, runner)
    assert scheduler.kv_manager.pool.num_used_blocks == 0 and scheduler.requests == {}


def test_a_fork_shares_a_running_source_and_queues_behind_a_preempted_one():
    """Beam search may fork a beam the scheduler preempted after it sampled: it has no blocks to share, so the
    new beam waits to compute the same tokens."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    source = request("s", prompt_len=5)
    scheduler.add_request(source)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, ModelRunnerOutput([], [], []))
    shared = request("shared", prompt_len=5, arrival=1.0)
    scheduler.fork(source, shared)
    assert shared in scheduler.running and kv.get_block_table("shared") == kv.get_block_table("s")
    assert shared.num_computed_tokens == 5 and shared.all_token_ids == source.all_token_ids
    scheduler.running.remove(source)
    scheduler._preempt(source, SchedulerOutput())
    queued = request("queued", prompt_len=5, arrival=2.0)
    scheduler.fork(source, queued)
    assert queued in scheduler.waiting and "queued" not in kv.block_tables and queued.num_computed_tokens == 0
    assert queued.all_token_ids == source.all_token_ids


@st.composite
def workloads(draw):
    """Requests of every kind, arriving over the first steps, some aborted at a chosen step."""
    jobs = []
    for index in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["plain", "parallel", "beam"]))
        jobs.append(dict(kind=kind, prompt_len=draw(st.integers(1, 40)), max_tokens=draw(st.integers(1, 12)),
                         width=draw(st.integers(2, 3)), arrival=draw(st.integers(0, 6)),
                         abort_at=draw(st.none() | st.integers(0, 30)), first_token=index * 7 % 50))
    return jobs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=workloads(), num_blocks=st.integers(12, 40), block_size=st.sampled_from([4, 8]),
       budget=st.sampled_from([8, 32, 128]), shared_prefix=st.booleans())
def test_the_workers_batch_mirrors_the_scheduler_through_any_traffic(jobs, num_blocks, block_size, budget,
                                                                     shared_prefix):
    """Preemption, prefix hits, forks, beams, copy on write, aborts: after every step the runner's batch holds
    exactly what the scheduler holds (assert_batch_mirrors_scheduler), and everything is freed at the end."""
    scheduler, runner = engine(num_blocks=num_blocks, block_size=block_size, max_num_seqs=6, budget=budget)
    kv = scheduler.kv_manager
    live: dict[int, list] = {}
    for now in itertools.count():
        for index, job in enumerate(jobs):
            if job["arrival"] == now:
                first = 10 if shared_prefix else 10 + job["first_token"]
                prompt = list(range(first, first + job["prompt_len"]))
                if not kv.can_ever_fit(len(prompt) + job["max_tokens"]):
                    continue
                if job["kind"] == "beam":
                    search = BeamSearch(f"b{index}", prompt, BeamSearchParams(job["width"], job["max_tokens"]),
                                        (EOS,), job["max_tokens"], arrival_time=float(now))
                    scheduler.add_request(search.first_request)
                    live[index] = ["beam", search]
                else:
                    width = job["width"] if job["kind"] == "parallel" else 1
                    sequences = [Request(f"{i}_r{index}", prompt, PLAIN, (EOS,), job["max_tokens"],
                                         arrival_time=float(now)) for i in range(width)]
                    scheduler.add_request(sequences[0], sequences[1:])
                    live[index] = ["plain", sequences]
            if job["abort_at"] == now and index in live:
                kind, held = live.pop(index)
                if kind == "beam":
                    held.abort(scheduler)
                else:
                    for sequence in held:
                        scheduler.finish(sequence, RequestStatus.FINISHED_ABORTED)
        if now > max(job["arrival"] for job in jobs) and not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner)
        assert now < 2000, "no progress"
    assert kv.pool.num_used_blocks == 0 and kv.block_tables == {} and scheduler.requests == {}
    plan = scheduler.schedule()
    runner.execute_model(plan)
    assert runner.input_batch.req_ids == [] and runner.input_batch.row_of == {}
    assert plan.num_scheduled_tokens == {}
