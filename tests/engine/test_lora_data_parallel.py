"""LoRA adapters on Ray data-parallel replicas (a real local Ray cluster, a tiny random Llama, a peft-made adapter):
an adapter added at run time is on every replica, requests with it answer on either replica as one in-process
engine does, a refused adapter is on none, and removing it takes it off all."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import pytest

from pagedllm import LLM
from pagedllm.bench.lora_adapters import make_random_adapters
from pagedllm.config import EngineConfig
from pagedllm.engine.stats import EngineStats
from pagedllm.kv.manager import KVCacheUsage
from pagedllm.lora.request import LoRAInUseError, LoRARequest
from tests.utils import greedy, random_prompts

ENGINE_SETTINGS = dict(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=8)
TIMEOUT = 120   # seconds: a call that never answers fails the test, not hangs it
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # before Ray starts: nothing leaves the machine


def test_combined_stats_name_each_adapter_running_or_waiting_on_any_replica():
    """What /metrics' lora_requests_info shows for several replicas: every adapter once, in name order."""
    from pagedllm.engine.stats import combine_stats

    kv = KVCacheUsage(**{field.name: 0 for field in dataclasses.fields(KVCacheUsage)})
    idle = EngineStats(kv_cache=kv, num_running=0, num_waiting=0, num_preemptions=0, last_step=None, max_lora=4)
    first = dataclasses.replace(idle, running_lora_adapters=("sql", "french"), waiting_lora_adapters=("german",))
    second = dataclasses.replace(idle, running_lora_adapters=("french",), waiting_lora_adapters=("sql",))
    combined = combine_stats([first, second, idle])
    assert combined.running_lora_adapters == ("french", "sql")
    assert combined.waiting_lora_adapters == ("german", "sql")
    assert combined.max_lora == 4


@pytest.fixture(scope="module")
def ray_module():
    return pytest.importorskip("ray", reason="Ray is not installed: pip install 'pagedllm[ray]'")


@pytest.fixture(scope="module")
def model_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-dp"), "llama")


@pytest.fixture(scope="module")
def adapter_path(model_dir, tmp_path_factory):
    return str(make_random_adapters(str(model_dir), tmp_path_factory.mktemp("lora-dp-adapter"), 1, rank=8)[0])


def test_serve_with_two_replicas_loads_lora_modules_on_both(ray_module, model_dir, adapter_path, tmp_path,
                                                            monkeypatch):
    """`pagedllm serve --data-parallel-size 2 --lora-modules`: the adapter is a model, answers as one in-process
    engine with it does, and the server stops without leaving a process behind. (First in the module: its Ray
    cluster is the server's own, started before the module's replicas.)"""
    import psutil

    from pagedllm.bench.server_process import ServerProcess

    monkeypatch.setenv("RAY_ADDRESS", "local")   # the server starts a Ray cluster of its own
    server = ServerProcess(tmp_path / "server.log", str(model_dir), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                           "--data-parallel-size", "2", "--enable-lora", "--max-lora-rank", "8",
                           "--served-model-name", "tiny", "--lora-modules", f"adapter={adapter_path}")
    descendants = psutil.Process(server.process.pid).children(recursive=True)
    try:
        client = server.openai_client()
        models = [model.id for model in client.models.list().data]
        prompts = [prompt["prompt_token_ids"] for prompt in random_prompts(2, seed=9)]
        texts = [client.completions.create(model="adapter", prompt=prompt, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for prompt in prompts]
        log = server.log()
    finally:
        server.stop()
        _, alive = psutil.wait_procs(descendants, timeout=TIMEOUT)
        for process in alive:
            process.kill()
    assert not alive, f"pagedllm serve left processes behind: {[process.pid for process in alive]}"
    assert models == ["tiny", "adapter"]
    assert f"LoRA adapters: adapter (id 1, {adapter_path})" in log
    expected = LLM(str(model_dir), **ENGINE_SETTINGS).generate(
        [{"prompt_token_ids": prompt} for prompt in prompts], greedy(6), use_tqdm=False,
        lora_request=LoRARequest("adapter", 1, adapter_path))
    assert texts == [output.outputs[0].text for output in expected]


@pytest.fixture(scope="module")
def replicas(ray_module, model_dir):
    from pagedllm.engine.data_parallel import DPAsyncLLM

    ray_module.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        llm = DPAsyncLLM.from_config(EngineConfig(model=str(model_dir), data_parallel_size=2, **ENGINE_SETTINGS))
        yield llm
        asyncio.run(llm.shutdown())
    finally:
        ray_module.shutdown()


def run(coroutine):
    async def bounded():
        return await asyncio.wait_for(coroutine, TIMEOUT)
    return asyncio.run(bounded())


def adapters_on_each_replica(llm) -> list[set[int]]:
    import ray

    return ray.get([replica.actor.list_loras.remote() for replica in llm.replicas], timeout=TIMEOUT)


def test_an_adapter_added_at_run_time_serves_on_both_replicas(replicas, model_dir, adapter_path):
    adapter = LoRARequest("runtime", 1, adapter_path)
    prompts = random_prompts(2, seed=3)
    params = greedy(8)

    async def scenario():
        added = await replicas.add_lora(adapter)
        served_before = {i: s.num_requests_served for i, s in (await replicas.replica_stats()).items()}
        outputs = []
        for index, prompt in enumerate(prompts):   # one at a time: the idle replica given fewer takes the next
            stream = [output async for output in replicas.generate(prompt, params, f"lora-{index}",
                                                                   lora_request=adapter)]
            outputs.append(stream[-1].outputs[0].token_ids)
        served = {i: s.num_requests_served - served_before[i] for i, s in (await replicas.replica_stats()).items()}
        return added, outputs, served, await replicas.list_loras()

    added, outputs, served, listed = run(scenario())
    assert added and listed == {1}
    assert adapters_on_each_replica(replicas) == [{1}, {1}]
    assert served == {0: 1, 1: 1}
    offline = LLM(str(model_dir), **ENGINE_SETTINGS)
    expected = offline.generate(prompts, params, use_tqdm=False, lora_request=adapter)
    base = offline.generate(prompts, params, use_tqdm=False)
    assert outputs == [output.outputs[0].token_ids for output in expected]
    assert outputs != [output.outputs[0].token_ids for output in base]
    assert run(replicas.remove_lora(1)) is True
    assert adapters_on_each_replica(replicas) == [set(), set()]
    assert run(replicas.remove_lora(1)) is False


def test_prefix_routing_keeps_an_adapters_cached_prompt_apart_from_the_base(replicas, adapter_path):
    """The router hashes a prompt as the replicas' prefix caches do, adapter included: the prompt cached under the
    adapter draws the adapter's next request to its replica (reason prefix), never a base request (reason load)."""
    adapter = LoRARequest("routed", 3, adapter_path)
    prompt = random_prompts(1, seed=11, min_len=40, max_len=40)[0]   # two full blocks of 16 before its last token

    async def reason_of(request_id: str, lora_request) -> tuple[int, str]:
        before = {replica.index: dict(replica.routed) for replica in replicas.replicas}
        [output async for output in replicas.generate(prompt, greedy(2), request_id, lora_request=lora_request)]
        moved = [(replica.index, reason) for replica in replicas.replicas for reason, count in replica.routed.items()
                 if count != before[replica.index][reason]]
        assert len(moved) == 1, moved
        return moved[0]

    async def scenario():
        await replicas.add_lora(adapter)
        try:
            return [await reason_of("first", adapter), await reason_of("base", None),
                    await reason_of("again", adapter)]
        finally:
            await replicas.remove_lora(adapter.lora_int_id)

    (first, first_reason), (_, base_reason), (again, again_reason) = run(scenario())
    assert (first_reason, base_reason) == ("load", "load")
    assert (again, again_reason) == (first, "prefix")


def park_request(replica, request_id: str, lora_request: LoRARequest) -> None:
    """Runs inside a replica's actor: a request with the adapter put straight into its idle engine, without waking
    the step loop, so it waits there, unfinished, until unpark_request takes it out (no timing involved)."""
    replica.llm.engine.add_request(request_id, {"prompt_token_ids": [5, 6, 7]}, greedy(4), lora_request=lora_request)


def unpark_request(replica, request_id: str) -> None:
    replica.llm.engine.abort_request(request_id)


def test_an_unload_refused_on_one_replica_leaves_the_adapter_on_every_replica(replicas, adapter_path):
    import ray

    adapter = LoRARequest("parked", 4, adapter_path)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the replicas need not import this module
    run(replicas.add_lora(adapter))
    first = replicas.replicas[0].actor
    ray.get(first.__ray_call__.remote(park_request, "parked-0", adapter), timeout=TIMEOUT)
    try:
        with pytest.raises(LoRAInUseError):
            run(replicas.remove_lora(adapter.lora_int_id))
        assert adapters_on_each_replica(replicas) == [{4}, {4}]   # the replica that had dropped it took it back
    finally:
        ray.get(first.__ray_call__.remote(unpark_request, "parked-0"), timeout=TIMEOUT)
    assert run(replicas.remove_lora(adapter.lora_int_id)) is True
    assert adapters_on_each_replica(replicas) == [set(), set()]


def test_a_refused_adapter_is_on_no_replica(replicas, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")   # a folder that is no PEFT adapter
    with pytest.raises(ValueError):
        run(replicas.add_lora(LoRARequest("broken", 2, str(tmp_path))))
    assert adapters_on_each_replica(replicas) == [set(), set()]


def test_prefix_routing_keys_a_prompt_by_its_adapter(replicas, adapter_path):
    """A 40-token prompt (2 full blocks before its last token) with an adapter, then again with it: the second goes
    to the replica holding it, for that prefix, and hits its 32 tokens there. The same prompt on the base model
    is cached under another key on the replicas, so the router finds no affinity for it either: no new hit."""
    adapter = LoRARequest("affinity", 3, adapter_path)
    prompt = random_prompts(1, seed=41, min_len=40, max_len=40)[0]

    async def scenario():
        await replicas.add_lora(adapter)
        try:
            figures = []
            for index, lora_request in enumerate((adapter, adapter, None)):
                before = await replicas.stats()
                [output async for output in replicas.generate(prompt, greedy(2), f"affinity-{index}",
                                                              lora_request=lora_request)]
                after = await replicas.stats()
                figures.append((before, after))
            return figures
        finally:
            await replicas.remove_lora(3)

    def reasons(stats) -> dict[str, int]:
        return {reason: sum(r[reason] for r in stats.data_parallel.routed.values())
                for reason in ("prefix", "balance", "load")}

    def delta(before, after) -> tuple[dict[str, int], int]:
        new_reasons = {k: reasons(after)[k] - reasons(before)[k] for k in ("prefix", "balance", "load")}
        return new_reasons, after.kv_cache.prefix_cache_hits - before.kv_cache.prefix_cache_hits

    figures = run(scenario())
    assert [delta(*pair) for pair in figures] == [({"prefix": 0, "balance": 0, "load": 1}, 0),
                                                  ({"prefix": 1, "balance": 0, "load": 0}, 32),
                                                  ({"prefix": 0, "balance": 0, "load": 1}, 0)]
