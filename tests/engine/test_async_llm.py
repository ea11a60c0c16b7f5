"""AsyncLLM on a tiny random Llama: many concurrent callers, streaming, cancellation, failure isolation."""
import asyncio
import threading
import time

import pytest

from pagedllm import LLM
from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineRequestError
from pagedllm.engine.protocol import EngineOverloadedError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import RequestOutputKind
from tests.utils import collect, greedy, random_prompts

ENGINE_SETTINGS = dict(dtype="float32", kv_cache_memory="16MiB")
TIMEOUT = 30   # seconds: a stream that never ends must fail the test, not hang it


@pytest.fixture(scope="module")
def model_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("async-llm"), "llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_SETTINGS))


@pytest.fixture(autouse=True)
def engine_left_idle(engine):
    """Every test must leave the shared engine with no requests and every KV block free."""
    yield
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


@pytest.fixture
def step_count(engine, monkeypatch):
    """Counts engine steps: steps[0] grows by one per engine.step() call."""
    steps = [0]
    real_step = engine.step

    def counted_step():
        steps[0] += 1
        return real_step()

    monkeypatch.setattr(engine, "step", counted_step)
    return steps


def serve(engine, scenario):
    """Runs scenario(llm) on a fresh event loop with an AsyncLLM over the shared engine."""
    async def main():
        llm = AsyncLLM(engine)
        try:
            return await asyncio.wait_for(scenario(llm), TIMEOUT)
        finally:
            await llm.shutdown()
    return asyncio.run(main())


async def collect_many(llm, prompts, params, prefix):
    """Streams every prompt at once; a failed request's entry is its exception."""
    return await asyncio.gather(*(collect(llm, p, params, f"{prefix}{i}") for i, p in enumerate(prompts)),
                                return_exceptions=True)


async def wait_until(condition, message):
    """Polls condition() until it holds; fails after TIMEOUT seconds."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.001)


async def wait_until_idle(engine):
    await wait_until(lambda: not engine.has_unfinished_requests(), "the engine still holds the request")


def num_output_tokens(engine, request_id):
    child = engine.children.get(request_id)
    return 0 if child is None else child.request.num_output_tokens


def test_many_concurrent_callers_match_the_offline_api(engine, model_dir):
    prompts = random_prompts(120)
    params = [greedy(8 + i % 9) for i in range(len(prompts))]

    async def scenario(llm):
        return await asyncio.gather(*(collect(llm, prompt, p, f"req-{i}")
                                      for i, (prompt, p) in enumerate(zip(prompts, params))))

    streams = serve(engine, scenario)
    offline = LLM(str(model_dir), **ENGINE_SETTINGS).generate(prompts, params, use_tqdm=False)
    for i, (stream, expected) in enumerate(zip(streams, offline)):
        final = stream[-1]
        assert final.finished and not any(o.finished for o in stream[:-1])
        assert final.request_id == f"req-{i}"
        assert final.outputs[0].token_ids == expected.outputs[0].token_ids
        assert final.outputs[0].text == expected.outputs[0].text
        assert final.outputs[0].finish_reason == "length"


def test_delta_streams_add_up_to_the_cumulative_output(engine):
    prompts = random_prompts(6, seed=1)

    async def scenario(llm):
        deltas = [collect(llm, p, greedy(20, output_kind=RequestOutputKind.DELTA), f"delta-{i}")
                  for i, p in enumerate(prompts)]
        cumulative = [collect(llm, p, greedy(20), f"cumulative-{i}") for i, p in enumerate(prompts)]
        return await asyncio.gather(*deltas, *cumulative)

    results = serve(engine, scenario)
    for delta_stream, cumulative_stream in zip(results[:6], results[6:]):
        assert len(delta_stream) > 1
        assert sum((o.outputs[0].token_ids for o in delta_stream), []) == \
            cumulative_stream[-1].outputs[0].token_ids
        assert "".join(o.outputs[0].text for o in delta_stream) == cumulative_stream[-1].outputs[0].text


def test_final_only_yields_one_output(engine):
    prompt = random_prompts(1, seed=2)[0]
    final_only = greedy(12, output_kind=RequestOutputKind.FINAL_ONLY)
    stream = serve(engine, lambda llm: collect(llm, prompt, final_only, "final"))
    assert len(stream) == 1 and stream[0].finished and len(stream[0].outputs[0].token_ids) == 12


@pytest.mark.parametrize("how", ["break", "aclose", "cancel", "abort"])
def test_stopping_a_stream_mid_way_aborts_the_request(engine, step_count, how):
    prompt = random_prompts(1, seed=3)[0]
    long_run = greedy(400)

    async def scenario(llm):
        if how == "break":
            async for output in llm.generate(prompt, long_run, "r"):
                if len(output.outputs[0].token_ids) >= 3:
                    break
        elif how == "aclose":
            stream = llm.generate(prompt, long_run, "r")
            await anext(stream)
            await stream.aclose()
        elif how == "cancel":
            consumer = asyncio.create_task(collect(llm, prompt, long_run, "r"))
            await wait_until(lambda: num_output_tokens(engine, "r") >= 3, "the request never decoded")
            consumer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await consumer
        else:
            consumer = asyncio.create_task(collect(llm, prompt, long_run, "r"))
            await wait_until(engine.has_unfinished_requests, "the request never reached the engine")
            await llm.abort("r")
            stream = await consumer
            assert not any(o.finished for o in stream)
        await wait_until_idle(engine)
        assert step_count[0] < 100, "the request ran on instead of being aborted"
        # The request id is free again and the engine still serves.
        return await collect(llm, prompt, greedy(4), "r")

    assert serve(engine, scenario)[-1].finished


def test_the_loop_sleeps_while_idle_and_wakes_for_new_requests(engine, step_count):
    prompt = random_prompts(1, seed=10)[0]

    async def scenario(llm):
        await collect(llm, prompt, greedy(5), "first")
        steps_before = step_count[0]
        # Round trips through the engine's one thread, queued behind any step the loop submits: a loop that
        # kept stepping while idle would fit about one step between each two of them.
        for _ in range(20):
            await llm.call_in_engine_thread(lambda: None)
        assert step_count[0] - steps_before <= 1   # at most the step that found nothing left to do
        return await collect(llm, prompt, greedy(5), "second")

    assert serve(engine, scenario)[-1].finished


def test_an_invalid_request_fails_alone(engine):
    good = random_prompts(4, seed=4)
    too_long = {"prompt_token_ids": [5] * 500}

    async def scenario(llm):
        return await asyncio.gather(collect(llm, too_long, greedy(100), "bad"),
                                    collect_many(llm, good, greedy(10), "good-"), return_exceptions=True)

    bad, goods = serve(engine, scenario)
    assert isinstance(bad, ValueError) and "max_model_len" in str(bad)
    assert all(stream[-1].finished and len(stream[-1].outputs[0].token_ids) == 10 for stream in goods)


def test_past_max_waiting_requests_a_request_is_refused_and_each_waiting_one_counts_once(engine):
    """While no step runs, three requests fill max_waiting_requests=3 and a fourth is refused. A request listener
    reads the count on the engine thread as each request joins the scheduler's queue: it must see 1, 2, 3. Once
    a request was counted both as being added and as queued, and a burst was refused one request early."""
    prompts = random_prompts(4, seed=6)
    release = threading.Event()
    counts_seen = []

    async def scenario(llm):
        llm.max_waiting_requests = 3
        engine.core.request_listeners.append(lambda request, siblings: counts_seen.append(llm.num_waiting_requests))
        engine.core.step_gates.append(lambda: release.wait(0.005))   # shut (polling) until released
        try:
            queued = []
            for index, prompt in enumerate(prompts[:3]):
                queued.append(asyncio.create_task(collect(llm, prompt, greedy(4), f"queued-{index}")))
                await wait_until(lambda: len(engine.scheduler.waiting) == index + 1, "the request was not queued")
            with pytest.raises(EngineOverloadedError, match="3 requests are waiting"):
                await collect(llm, prompts[3], greedy(4), "refused")
            release.set()
            return await asyncio.gather(*queued)
        finally:
            engine.core.request_listeners.pop()
            engine.core.step_gates.pop()

    streams = serve(engine, scenario)
    assert counts_seen == [1, 2, 3]
    assert all(stream[-1].finished and len(stream[-1].outputs[0].token_ids) == 4 for stream in streams)


def test_duplicate_request_id_is_refused(engine):
    prompt = random_prompts(1, seed=5)[0]

    async def scenario(llm):
        first = asyncio.create_task(collect(llm, prompt, greedy(30), "same"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="already in use"):
            await collect(llm, prompt, greedy(30), "same")
        return await first

    assert serve(engine, scenario)[-1].finished


def test_a_request_failing_inside_the_engine_fails_alone(engine, fail_request_at):
    fail_request_at("doomed", 2)
    prompts = random_prompts(5, seed=6)

    async def scenario(llm):
        return await asyncio.gather(collect(llm, prompts[0], greedy(10), "doomed"),
                                    collect_many(llm, prompts[1:], greedy(10), "fine-"),
                                    return_exceptions=True)

    doomed, fine = serve(engine, scenario)
    assert isinstance(doomed, EngineRequestError) and doomed.request_id == "doomed"
    assert "injected failure" in str(doomed)
    assert all(stream[-1].finished and len(stream[-1].outputs[0].token_ids) == 10 for stream in fine)


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(engine, monkeypatch):
    real_execute = engine.runner.execute_model
    failed_batch = []

    def execute(scheduler_output):
        if not failed_batch:
            failed_batch.extend(scheduler_output.num_scheduled_tokens)
            raise RuntimeError("injected step failure")
        return real_execute(scheduler_output)

    monkeypatch.setattr(engine.runner, "execute_model", execute)
    prompts = random_prompts(4, seed=7)

    async def scenario(llm):
        in_flight = await collect_many(llm, prompts[:3], greedy(10), "r")
        return in_flight, await collect(llm, prompts[3], greedy(10), "after")

    in_flight, after = serve(engine, scenario)
    assert sorted(failed_batch) == ["r0", "r1", "r2"]
    for request_id, result in zip(["r0", "r1", "r2"], in_flight):
        assert isinstance(result, EngineRequestError) and result.request_id == request_id
        assert isinstance(result.__cause__, RuntimeError) and "injected step failure" in str(result)
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 10


def test_the_event_loop_keeps_running_while_the_engine_steps(engine, monkeypatch):
    """Each step blocks until the event loop has answered it: were the loop blocked by the step, as it would
    be if steps ran on it, no step could end."""
    real_execute = engine.runner.execute_model
    stepping, answered = threading.Event(), threading.Event()

    def execute_once_answered(scheduler_output):
        answered.clear()
        stepping.set()
        if not answered.wait(TIMEOUT):
            raise RuntimeError("the event loop did not run while the step blocked")
        return real_execute(scheduler_output)

    monkeypatch.setattr(engine.runner, "execute_model", execute_once_answered)
    prompts = random_prompts(4, seed=8)

    async def scenario(llm):
        answers = 0
        generation = asyncio.gather(*(collect(llm, p, greedy(3), f"t{i}") for i, p in enumerate(prompts)))
        while not generation.done():
            if stepping.is_set():
                stepping.clear()
                answered.set()
                answers += 1
            await asyncio.sleep(0.001)
        return await generation, answers

    streams, answers = serve(engine, scenario)
    assert all(stream[-1].finished for stream in streams)
    assert answers >= 3   # one prefill and two decode steps at least


def test_shutdown_ends_in_flight_streams_and_refuses_new_ones(engine):
    prompt = random_prompts(1, seed=9)[0]

    async def scenario():
        llm = AsyncLLM(engine)
        consumer = asyncio.create_task(collect(llm, prompt, greedy(400), "r"))
        await wait_until(engine.has_unfinished_requests, "the request never reached the engine")
        await llm.shutdown()
        with pytest.raises(EngineDeadError):
            await consumer
        with pytest.raises(EngineDeadError):
            await collect(llm, prompt, greedy(4), "late")

    asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))


def test_if_the_loop_dies_every_caller_gets_engine_dead_error(engine, monkeypatch):
    real_abort_request = engine.abort_request
    abort_calls = []

    def execute(*args):
        raise RuntimeError("injected step failure")

    def abort_request(request_ids):
        abort_calls.append(request_ids)
        if len(abort_calls) == 1:
            raise RuntimeError("injected abort failure")   # the clean-up after the failed step fails too
        real_abort_request(request_ids)

    monkeypatch.setattr(engine.runner, "execute_model", execute)
    monkeypatch.setattr(engine, "abort_request", abort_request)
    prompts = random_prompts(2, seed=11)

    async def scenario(llm):
        in_flight = await collect_many(llm, prompts, greedy(5), "r")
        with pytest.raises(EngineDeadError):
            await collect(llm, prompts[0], greedy(5), "late")
        return in_flight

    in_flight = serve(engine, scenario)   # shutdown() still clears the engine
    assert all(isinstance(result, EngineDeadError) for result in in_flight)
