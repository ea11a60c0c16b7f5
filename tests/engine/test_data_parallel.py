"""Data-parallel engine replicas on Ray, on a tiny random Llama: outputs against one in-process engine,
routing, aborts, a killed replica, `pagedllm serve` with the openai client, and two Ray nodes in two
network namespaces. The Ray cluster is real (ray.init(num_cpus=2), or `ray start` processes); no test
leaves a process behind (psutil)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.server_process import poll
from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import EngineRequestError
from pagedllm.engine.stats import EngineStats, StepStats
from pagedllm.entrypoints.cli import parse_args
from pagedllm.kv.manager import KVCacheUsage
from tests.utils import collect, greedy, random_prompts

ENGINE_SETTINGS = dict(dtype="float32", kv_cache_memory="16MiB")
TIMEOUT = 120          # seconds: a stream or a cluster that never answers fails the test, not hangs it
# max_tokens of a request the test acts on while it runs: a StepGate holds its replica after its first
# output, so it stays running (holding its blocks) however fast the machine steps.
LONG = 32
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # before Ray starts: nothing leaves the machine


# ---- settings (no Ray needed) ----

def test_one_engine_refuses_several_replicas(tmp_path):
    from pagedllm.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="data_parallel_size must be 1 for one LLMEngine, got 2"):
        LLMEngine(EngineConfig(model=str(tmp_path), data_parallel_size=2))


def test_backend_defaults_to_ray_with_several_replicas_and_mp_with_one():
    assert EngineConfig().distributed_executor_backend == "mp"
    assert EngineConfig(data_parallel_size=2).distributed_executor_backend == "ray"
    assert EngineConfig(distributed_executor_backend="ray").data_parallel_size == 1


@pytest.mark.parametrize("settings, message", [
    (dict(data_parallel_size=0), "data_parallel_size must be an integer >= 1, got 0"),
    (dict(data_parallel_size=2, distributed_executor_backend="mp"),
     "data_parallel_size > 1 needs distributed_executor_backend 'ray'"),
    (dict(distributed_executor_backend="uni"), "distributed_executor_backend must be one of mp, ray, got 'uni'"),
])
def test_settings_that_cannot_run_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_flags_and_yaml_reach_the_config(tmp_path):
    args = parse_args(["serve", "--data-parallel-size", "2", "--distributed-executor-backend", "ray"])
    assert (args.engine_config.data_parallel_size, args.engine_config.distributed_executor_backend) == (2, "ray")
    config_file = tmp_path / "dp.yaml"
    config_file.write_text("engine_args:\n  data-parallel-size: 3\n")
    args = parse_args(["serve", "--config", str(config_file)])
    assert (args.engine_config.data_parallel_size, args.engine_config.distributed_executor_backend) == (3, "ray")


def test_routing_defaults_to_prefix_with_several_replicas_and_prefix_caching():
    assert EngineConfig(data_parallel_size=2).data_parallel_routing == "prefix"
    assert EngineConfig(data_parallel_size=2, enable_prefix_caching=False).data_parallel_routing == "least-loaded"
    assert EngineConfig().data_parallel_routing == "least-loaded"
    args = parse_args(["serve", "--data-parallel-size", "2", "--data-parallel-routing", "least-loaded",
                       "--data-parallel-balance-abs-threshold", "3"])
    config = args.engine_config
    assert (config.data_parallel_routing, config.data_parallel_balance_abs_threshold) == ("least-loaded", 3)


@pytest.mark.parametrize("settings, message", [
    (dict(data_parallel_routing="random"), "data_parallel_routing must be one of prefix, least-loaded, got 'random'"),
    (dict(data_parallel_routing="prefix", enable_prefix_caching=False),
     "data_parallel_routing 'prefix' routes by the replicas' prefix caches: it needs enable_prefix_caching=True"),
    (dict(data_parallel_balance_abs_threshold=-1), "data_parallel_balance_abs_threshold must be an integer >= 0, got -1"),
])
def test_routing_settings_that_cannot_run_are_refused(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(data_parallel_size=2, **settings)


def _stats(num_blocks, used, running, waiting, hits, queries, step):
    kv = KVCacheUsage(num_blocks=num_blocks, num_used_blocks=used, num_free_blocks=num_blocks - used,
                      num_pinned_blocks=0, num_cached_idle_blocks=1, num_shared_blocks=0, num_logical_blocks=used,
                      num_tokens_stored=used,
                      block_size=16, prefix_cache_queries=queries, prefix_cache_hits=hits)
    return EngineStats(kv_cache=kv, num_running=running, num_waiting=waiting, num_preemptions=1, last_step=step)


def test_combined_stats_sum_counts_and_pool_kv_usage():
    from pagedllm.engine.stats import combine_stats

    step = StepStats(scheduling_seconds=0.001, prepare_seconds=0.0005, model_seconds=0.5, num_seqs=3, num_tokens=40,
                     num_preemptions=0)
    combined = combine_stats([_stats(100, 90, 3, 2, 10, 40, step), _stats(300, 30, 1, 0, 0, 60, None)])
    assert combined.kv_cache.usage == pytest.approx(120 / 400)   # not the mean of 0.9 and 0.1
    assert combined.kv_cache.prefix_cache_hit_rate == pytest.approx(10 / 100)
    assert (combined.num_running, combined.num_waiting, combined.num_preemptions) == (4, 2, 2)
    assert (combined.kv_cache.num_free_blocks, combined.kv_cache.num_cached_idle_blocks) == (280, 2)
    assert combined.last_step == step
    assert combined.kv_disk is None


def test_combined_stats_sum_the_disk_tiers_speculation_and_adapters_per_step():
    from pagedllm.engine.stats import combine_stats
    from pagedllm.engine.stats import KVDiskStats
    from pagedllm.spec_decode.metrics import SpecDecodingStats

    def step(num_loras):
        return StepStats(scheduling_seconds=0.001, prepare_seconds=0.001, model_seconds=0.1, num_seqs=2, num_tokens=2,
                         num_preemptions=0, num_loras=num_loras)
    first = dataclasses.replace(_stats(100, 10, 0, 0, 0, 0, step(2)), kv_disk=KVDiskStats(5, 50, 7, 1, 9, 2, 700, 900, 1),
                                spec_decoding=SpecDecodingStats(2, 3, 6, 4, [3, 1]))
    second = dataclasses.replace(_stats(100, 20, 0, 0, 0, 0, step(1)), kv_disk=KVDiskStats(6, 50, 3, 0, 4, 1, 300, 400, 0),
                                 spec_decoding=SpecDecodingStats(2, 1, 2, 2, [1, 1]))
    combined = combine_stats([first, second])
    assert (combined.last_step.num_seqs, combined.last_step.num_loras) == (4, 3)
    assert combined.kv_disk == KVDiskStats(num_blocks=11, capacity_blocks=100, hit_blocks=10, read_failures=1,
                                           spilled_blocks=13, evicted_blocks=3, bytes_read=1000, bytes_written=1300,
                                           stale_files_removed=1)
    assert (combined.spec_decoding.num_drafts, combined.spec_decoding.num_accepted_tokens_per_pos) == (4, [4, 2])
    assert combine_stats([first, _stats(100, 0, 0, 0, 0, 0, None)]).kv_disk == first.kv_disk


# ---- a local Ray cluster ----

@pytest.fixture(scope="module")
def ray_module():
    return pytest.importorskip("ray", reason="Ray is not installed: pip install 'pagedllm[ray]'")


def wait_for_exit(processes: list[psutil.Process], what: str) -> None:
    """Every process must be gone within TIMEOUT seconds: none may outlive the test."""
    _, alive = psutil.wait_procs(processes, timeout=TIMEOUT)
    for process in alive:
        process.kill()
    assert not alive, f"{what} left processes behind: {[p.pid for p in alive]}"


@pytest.fixture(scope="module")
def ray_cluster(ray_module):
    before = set(psutil.Process().children(recursive=True))   # earlier tests' subprocesses are not Ray's
    ray_module.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        yield ray_module
    finally:
        started = [process for process in psutil.Process().children(recursive=True) if process not in before]
        ray_module.shutdown()
        wait_for_exit(started, "ray.shutdown()")


@pytest.fixture(scope="module")
def model_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("data-parallel"), "llama", max_position_embeddings=4096)


def start_replicas(model_dir):
    from pagedllm.engine.data_parallel import DPAsyncLLM

    return DPAsyncLLM.from_config(EngineConfig(model=str(model_dir), data_parallel_size=2, **ENGINE_SETTINGS))


@pytest.fixture
def llm(ray_cluster, model_dir):
    replicas = start_replicas(model_dir)
    yield replicas
    asyncio.run(replicas.shutdown())


async def wait_until_idle(llm) -> dict:
    """Polls the replicas' own figures until none holds a request or a block (a closed stream's abort is
    sent without waiting for it); returns the last figures, which the caller checks."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        stats = await llm.replica_stats()
        busy = any(s.engine.num_running or s.engine.num_waiting or s.engine.kv_cache.num_used_blocks
                   for s in stats.values())
        if not busy or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


@pytest.fixture
def replicas_left_idle(llm):
    """A test on the shared replicas must leave every replica with no request and every block free."""
    yield
    for index, stats in run(wait_until_idle(llm)).items():
        assert stats.engine.num_running == stats.engine.num_waiting == 0, f"replica {index} still holds requests"
        assert stats.engine.kv_cache.num_used_blocks == 0, f"replica {index} still holds KV blocks"


def run(coroutine):
    async def bounded():
        return await asyncio.wait_for(coroutine, TIMEOUT)
    return asyncio.run(bounded())


async def first_output(stream):
    """Advances a stream to its first output: the request is running (and holds blocks) on its replica."""
    return await stream.__anext__()


class StepGate:
    """Put on a replica's engine (inside its actor, by hold_after_first_output): once a step has given a
    first output to one of `request_ids`, the engine skips its steps while that request is in it, until
    released. Calls queued on the engine thread between steps still run (stats, aborts), so the test sees
    the request running, its blocks held, for as long as it needs."""

    POLL = 0.05   # seconds a held step waits for the release before the loop's next turn: no busy loop

    def __init__(self, engine, request_ids: set[str]):
        self.engine, self.request_ids = engine, request_ids
        self.real_step = engine.step
        self.held: set[str] = set()
        self.released = threading.Event()

    def step(self):
        if self.released.is_set() or not self.held.intersection(self.engine.parents):
            outputs = self.real_step()
            self.held.update(output.request_id for output in outputs if output.request_id in self.request_ids)
            return outputs
        self.released.wait(self.POLL)
        return []


def install_gate(replica, request_ids: set[str]) -> None:
    """Runs inside a replica's actor (Ray's __ray_call__ hands it the EngineReplica)."""
    replica.step_gate = StepGate(replica.llm.engine, request_ids)
    replica.llm.engine.step = replica.step_gate.step


def release_gate(replica) -> None:
    replica.step_gate.released.set()


def hold_after_first_output(llm, *request_ids: str) -> None:
    """Every replica holds its engine once one of request_ids has had its first output."""
    import ray

    # The gate's code travels by value: a replica's worker process need not import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.get([replica.actor.__ray_call__.remote(install_gate, set(request_ids)) for replica in llm.replicas],
            timeout=TIMEOUT)


def release(replica) -> None:
    import ray

    ray.get(replica.actor.__ray_call__.remote(release_gate), timeout=TIMEOUT)


def reference_outputs(model_dir, prompts, params):
    return LLM(str(model_dir), **ENGINE_SETTINGS).generate(prompts, params, use_tqdm=False)


@pytest.mark.usefixtures("replicas_left_idle")
def test_greedy_and_seeded_outputs_match_one_in_process_engine_and_both_replicas_serve(llm, model_dir):
    prompts = random_prompts(16)
    params = [greedy(6 + i % 5) if i % 2 else SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i,
                                                            max_tokens=6 + i % 5, ignore_eos=True)
              for i in range(len(prompts))]
    served_before = {i: s.num_requests_served for i, s in run(llm.replica_stats()).items()}

    async def scenario():
        return await asyncio.gather(*(collect(llm, prompt, p, f"match-{i}")
                                      for i, (prompt, p) in enumerate(zip(prompts, params))))

    streams = run(scenario())
    for i, (stream, expected) in enumerate(zip(streams, reference_outputs(model_dir, prompts, params))):
        final = stream[-1]
        assert final.finished and final.request_id == f"match-{i}"
        assert final.outputs[0].token_ids == expected.outputs[0].token_ids, f"prompt {i}"
        assert final.outputs[0].text == expected.outputs[0].text
    served = {i: s.num_requests_served - served_before[i] for i, s in run(llm.replica_stats()).items()}
    assert sorted(served) == [0, 1] and all(count > 0 for count in served.values()), served
    assert sum(served.values()) == len(prompts)


@pytest.mark.usefixtures("replicas_left_idle")
def test_requests_go_to_the_least_loaded_replica_and_stats_add_up(llm):
    hold_after_first_output(llm, "load-0", "load-1")

    async def scenario():
        streams = [llm.generate(prompt, greedy(LONG), f"load-{i}") for i, prompt in enumerate(random_prompts(2))]
        try:
            for stream in streams:   # the second is sent once the first runs, held, on its replica
                await first_output(stream)
            owners = {llm.replica_of(f"load-{i}").index for i in range(2)}
            return owners, await llm.replica_stats(), await llm.stats()
        finally:
            for stream in streams:
                await stream.aclose()   # aborts the request, which ends its replica's hold

    owners, replicas, combined = run(scenario())
    assert owners == {0, 1}   # the second request went to the replica that had none

    def total(figure):
        return sum(figure(s.engine) for s in replicas.values())
    # Both replicas are held: their figures stand still between the two reads.
    assert combined.num_running == total(lambda e: e.num_running) == 2
    assert combined.kv_cache.num_blocks == total(lambda e: e.kv_cache.num_blocks)
    assert combined.kv_cache.num_used_blocks == total(lambda e: e.kv_cache.num_used_blocks) > 0


@pytest.mark.usefixtures("replicas_left_idle")
@pytest.mark.parametrize("how", ["abort", "close"])
def test_an_abort_frees_the_blocks_on_the_owning_replica(llm, how):
    request_id = f"abort-{how}"
    hold_after_first_output(llm, request_id)

    async def scenario():
        stream = llm.generate(random_prompts(1, seed=7)[0], greedy(LONG), request_id)
        await first_output(stream)
        owner = llm.replica_of(request_id).index
        held = (await llm.replica_stats())[owner].engine
        if how == "abort":   # either way the request leaves the engine, which ends the hold
            await llm.abort(request_id)
            rest = [output async for output in stream]   # ends quietly, with no finished output
            assert not any(output.finished for output in rest)
        else:
            await stream.aclose()   # what a client disconnect does
        return held, (await wait_until_idle(llm))[owner].engine

    held, freed = run(scenario())
    assert held.num_running == 1 and held.kv_cache.num_used_blocks > 0
    assert freed.num_running == 0 and freed.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("routing", ["prefix", "least-loaded"])
def test_a_follow_up_turn_goes_to_the_replica_that_holds_its_history(ray_cluster, model_dir, routing):
    """Turn 1 (48 tokens: 2 full blocks before its last token) goes to replica 0 (both idle, neither given any);
    turn 2 resends the history plus a question. Least-loaded sends it to replica 1 (given fewer), where nothing
    is cached; prefix routing sends it to replica 0, whose prefix cache then serves the history: counted in that
    replica's own hits. Another tenant's salt on the same history finds no affinity and goes to replica 1."""
    from pagedllm.engine.data_parallel import DPAsyncLLM

    llm = DPAsyncLLM.from_config(EngineConfig(model=str(model_dir), data_parallel_size=2,
                                              data_parallel_routing=routing, **ENGINE_SETTINGS))
    history = random_prompts(1, seed=21, min_len=48, max_len=48)[0]["prompt_token_ids"]
    question = random_prompts(1, seed=22, min_len=8, max_len=8)[0]["prompt_token_ids"]

    async def scenario():
        try:
            first = await collect(llm, {"prompt_token_ids": history}, greedy(4), "turn-1")
            after_first = await llm.replica_stats()
            follow_up = history + first[-1].outputs[0].token_ids + question   # 60 tokens: 3 blocks of history
            await collect(llm, {"prompt_token_ids": follow_up}, greedy(4), "turn-2")
            after_second = await llm.replica_stats()
            await collect(llm, {"prompt_token_ids": follow_up, "cache_salt": "another tenant"}, greedy(4), "tenant")
            return after_first, after_second, await llm.stats()
        finally:
            await llm.shutdown()

    after_first, after_second, combined = run(scenario())
    assert {i: s.num_requests_served for i, s in after_first.items()} == {0: 1, 1: 0}
    hits = {i: s.engine.kv_cache.prefix_cache_hits for i, s in after_second.items()}
    served = {i: s.num_requests_served for i, s in after_second.items()}
    routed = combined.data_parallel.routed
    if routing == "prefix":
        assert served == {0: 2, 1: 0}
        # 52 tokens of turn 1 were computed (48 + 4 sampled, the last one not yet written): 3 full blocks cached,
        # and turn 2's lookup covers its first 59 tokens: all 3 hit.
        assert hits == {0: 3 * 16, 1: 0}
        assert routed == {0: {"prefix": 1, "balance": 0, "load": 1}, 1: {"prefix": 0, "balance": 0, "load": 1}}
    else:
        assert served == {0: 1, 1: 1} and hits == {0: 0, 1: 0}
        assert routed == {0: {"prefix": 0, "balance": 0, "load": 2}, 1: {"prefix": 0, "balance": 0, "load": 1}}
    assert combined.kv_cache.prefix_cache_hits == sum(hits.values())   # the tenant's request hit nothing
    assert combined.data_parallel.routing == routing


def test_killing_a_replica_fails_only_its_requests(ray_cluster, llm, model_dir, caplog):
    prompts = random_prompts(4, seed=3)
    expected = reference_outputs(model_dir, prompts, [greedy(LONG)] * 2 + [greedy(8)] * 2)

    hold_after_first_output(llm, "kill-0", "kill-1")

    async def scenario():
        streams = [llm.generate(prompt, greedy(LONG), f"kill-{i}") for i, prompt in enumerate(prompts[:2])]
        firsts = [await first_output(stream) for stream in streams]   # each running, held, on its replica
        victim = llm.replica_of("kill-0")
        survivor_index = 1 - victim.index
        ray_cluster.kill(victim.actor)
        release(llm.replicas[survivor_index])
        with pytest.raises(EngineRequestError, match=f"engine replica {victim.index} died"):
            async for _ in streams[0]:
                pass
        survivor = [firsts[1], *[output async for output in streams[1]]]
        # New requests skip the dead replica and are served by the one left.
        later = await asyncio.gather(*(collect(llm, prompt, greedy(8), f"after-{i}")
                                       for i, prompt in enumerate(prompts[2:], start=2)))
        stats = await llm.replica_stats()
        return victim.index, survivor_index, survivor, later, stats

    with caplog.at_level(logging.ERROR, logger="pagedllm.engine.data_parallel"):
        victim, survivor_index, survivor, later, stats = run(scenario())
    assert f"engine replica {victim} " in caplog.text and "failing its 1 in-flight requests" in caplog.text
    assert survivor[-1].finished and survivor[-1].outputs[0].token_ids == expected[1].outputs[0].token_ids
    for i, stream in enumerate(later, start=2):
        assert stream[-1].outputs[0].token_ids == expected[i].outputs[0].token_ids
    assert list(stats) == [survivor_index] and not llm.replicas[victim].alive
    assert stats[survivor_index].num_requests_served == 3


# ---- `pagedllm serve` with two Ray replicas, driven by the openai client ----

def test_openai_client_against_serve_with_two_ray_replicas(ray_module, model_dir, tmp_path, monkeypatch):
    """Completions (streamed too) and a refusal, then a two-turn conversation: turn 2 resends turn 1's 48-token
    prompt and answer plus a question, is routed to the replica holding that history, and both the response's
    cached_tokens and the combined /metrics count its 3 cached blocks."""
    import openai

    from pagedllm.bench.server_process import ServerProcess, metric

    history = random_prompts(1, seed=31, min_len=48, max_len=48)[0]["prompt_token_ids"]
    question = random_prompts(1, seed=32, min_len=8, max_len=8)[0]["prompt_token_ids"]
    (turn_1_expected,) = reference_outputs(model_dir, [{"prompt_token_ids": history}], greedy(4))
    follow_up = history + turn_1_expected.outputs[0].token_ids + question
    (turn_2_expected,) = reference_outputs(model_dir, [{"prompt_token_ids": follow_up}], greedy(4))
    monkeypatch.setenv("RAY_ADDRESS", "local")   # the server starts a Ray cluster of its own
    server = ServerProcess(tmp_path / "server.log", str(model_dir), "--dtype", "float32", "--kv-cache-memory",
                           "16MiB", "--data-parallel-size", "2", "--distributed-executor-backend", "ray",
                           "--served-model-name", "tiny")
    descendants = psutil.Process(server.process.pid).children(recursive=True)
    try:
        client = server.openai_client()
        # Token ids: the tiny model's vocabulary is the first 256 of the bundled tokenizer's.
        prompts = [p["prompt_token_ids"] for p in random_prompts(6, seed=5)]
        completions = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
                       for prompt in prompts]
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=8, temperature=0, stream=True) if chunk.choices)
        with pytest.raises(openai.BadRequestError, match="max_model_len"):   # a replica's own check: a 400
            client.completions.create(model="tiny", prompt=prompts[0], max_tokens=10_000)
        turns = [client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
                 for prompt in (history, follow_up)]
        figures = server.wait_until_idle()
        log = server.log()
    finally:
        server.stop()
        wait_for_exit(descendants, "pagedllm serve")
    expected = reference_outputs(model_dir, [{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(temperature=0, max_tokens=8))
    assert [c.choices[0].text for c in completions] == [e.outputs[0].text for e in expected]
    assert streamed == expected[0].outputs[0].text
    one_engine_blocks = LLM(str(model_dir), **ENGINE_SETTINGS).llm_engine.stats().kv_cache.num_blocks
    assert figures.total_blocks == figures.free_blocks == 2 * one_engine_blocks   # both replicas' pools
    assert sum(metric(figures.text, "pagedllm:request_success_total", finished_reason=reason)
               for reason in ("length", "stop")) == 9
    assert "2 Ray engine replicas" in log
    assert [turn.choices[0].text for turn in turns] == [turn_1_expected.outputs[0].text, turn_2_expected.outputs[0].text]
    # Turn 1 computed 51 tokens (48 + 4 sampled, the last not yet written): 3 full blocks, all found by turn 2.
    assert turns[1].usage.prompt_tokens_details.cached_tokens == 48
    # The streamed repeat of prompts[0] hit its own full blocks (before its last token) on the replica that held them.
    repeat_hits = 16 * ((len(prompts[0]) - 1) // 16)
    assert metric(figures.text, "pagedllm:prefix_cache_hits_total") == 48 + repeat_hits
    per_engine = [metric(figures.text, "pagedllm:dp_prefix_cache_hits_total", engine=str(i)) for i in range(2)]
    assert sum(per_engine) == 48 + repeat_hits
    assert sum(metric(figures.text, "pagedllm:dp_routed_requests_total", engine=str(i), reason="prefix")
               for i in range(2)) == 1 + (repeat_hits > 0)


# ---- two Ray nodes in two network namespaces joined by a veth pair ----

HEAD_IP, WORKER_IP = "10.213.0.1", "10.213.0.2"


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_namespaces():
    """(head namespace, worker namespace), joined by a veth pair; deleted, with the pair, on teardown."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = uuid.uuid4().hex[:6]
    head, worker = f"pllm-h-{tag}", f"pllm-w-{tag}"
    made = []
    try:
        for namespace in (head, worker):
            result = ip("netns", "add", namespace)
            if result.returncode:
                pytest.skip(f"network namespaces are not permitted here: {result.stderr.strip()}")
            made.append(namespace)
        head_veth, worker_veth = f"vh{tag}", f"vw{tag}"
        for command in (("link", "add", head_veth, "type", "veth", "peer", "name", worker_veth),
                        ("link", "set", head_veth, "netns", head), ("link", "set", worker_veth, "netns", worker),
                        ("-n", head, "addr", "add", f"{HEAD_IP}/24", "dev", head_veth),
                        ("-n", worker, "addr", "add", f"{WORKER_IP}/24", "dev", worker_veth),
                        ("-n", head, "link", "set", head_veth, "up"), ("-n", worker, "link", "set", worker_veth, "up"),
                        ("-n", head, "link", "set", "lo", "up"), ("-n", worker, "link", "set", "lo", "up")):
            result = ip(*command)
            assert result.returncode == 0, f"ip {' '.join(command)}: {result.stderr}"
        yield head, worker
    finally:
        for namespace in made:
            ip("netns", "del", namespace)   # takes its end of the veth pair, and so the pair, with it
        ip("link", "del", f"vh{tag}")       # only there if it never moved into a namespace
        listed = ip("netns", "list").stdout
        assert not any(namespace in listed for namespace in made), listed


class RayNode:
    """`ray start --block` inside a namespace, in a session of its own; stop() ends it and all it started."""

    def __init__(self, namespace: str, temp_dir: Path, log_path: Path, env: dict[str, str], *flags: str):
        self.temp_dir = temp_dir
        self.log_path = log_path
        command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                   "--num-cpus=1", f"--temp-dir={temp_dir}", *flags]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def wait_until_started(self) -> None:
        started = poll(lambda: "Ray runtime started" in self.log_path.read_text(errors="replace"),
                       lambda up: up or self.process.poll() is not None, TIMEOUT)
        assert started, f"ray start not up (exit code {self.process.poll()}):\n{self.log_path.read_text()}"

    def processes(self) -> list[psutil.Process]:
        """The node's processes: its session's, and any that carry its temp dir but left the session."""
        found = []
        for process in psutil.process_iter(["pid", "cmdline"]):
            try:
                in_session = os.getsid(process.pid) == self.process.pid
            except OSError:
                continue
            if in_session or str(self.temp_dir) in " ".join(process.info["cmdline"] or ()):
                found.append(process)
        return found

    def stop(self) -> None:
        processes = self.processes()
        for process in processes:
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        wait_for_exit(processes, "a ray node")


def test_replicas_on_two_ray_nodes_in_two_network_namespaces(ray_module, two_namespaces, model_dir, tmp_path):
    head_namespace, worker_namespace = two_namespaces
    temp_dir = Path(f"/tmp/pllm-ray-{uuid.uuid4().hex[:6]}")   # short: Ray's socket paths have a length limit
    # The cluster's own token, in the environment of its processes only: nothing is written to ~/.ray.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    nodes = []
    try:
        head = RayNode(head_namespace, temp_dir, tmp_path / "head.log", env, "--head", f"--node-ip-address={HEAD_IP}",
                       "--port=6379", "--include-dashboard=false", "--disable-usage-stats")
        nodes.append(head)
        head.wait_until_started()
        worker = RayNode(worker_namespace, temp_dir, tmp_path / "worker.log", env, f"--address={HEAD_IP}:6379",
                         f"--node-ip-address={WORKER_IP}")
        nodes.append(worker)
        worker.wait_until_started()
        prompts = [p["prompt_token_ids"] for p in random_prompts(6, seed=11)]
        driver = subprocess.run(["ip", "netns", "exec", head_namespace, sys.executable,
                                 str(Path(__file__).with_name("data_parallel_driver.py")), f"{HEAD_IP}:6379",
                                 str(model_dir), json.dumps(prompts)],
                                capture_output=True, text=True, env=env, timeout=TIMEOUT * 3)
        assert driver.returncode == 0, driver.stderr[-4000:]
        result = json.loads(driver.stdout.strip().splitlines()[-1])
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert len(set(result["nodes"])) == 2
    assert sorted(result["replica_nodes"]) == sorted(result["nodes"])   # one replica on each node
    assert all(count > 0 for count in result["served"].values()) and len(result["served"]) == 2
    expected = reference_outputs(model_dir, [{"prompt_token_ids": p} for p in prompts], greedy(8))
    assert result["tokens"] == [e.outputs[0].token_ids for e in expected]
