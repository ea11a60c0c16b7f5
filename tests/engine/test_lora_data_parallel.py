"""LoRA adapters on Ray data-parallel replicas (a real local Ray cluster, a tiny random Llama, a peft-made adapter):
an adapter added at run time is on every replica, requests with it answer on either replica as one in-process
engine does, a refused adapter is on none, and removing it takes it off all."""
from __future__ import annotations

import asyncio
import os

import pytest

from pagedllm import LLM
from pagedllm.bench.lora_adapters import make_random_adapters
from pagedllm.config import EngineConfig
from pagedllm.lora.request import LoRARequest
from tests.utils import greedy, random_prompts

ENGINE_SETTINGS = dict(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=8)
TIMEOUT = 120   # seconds: a call that never answers fails the test, not hangs it
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # before Ray starts: nothing leaves the machine


@pytest.fixture(scope="module")
def ray_module():
    return pytest.importorskip("ray", reason="Ray is not installed: pip install 'pagedllm[ray]'")


@pytest.fixture(scope="module")
def model_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-dp"), "llama")


@pytest.fixture(scope="module")
def adapter_path(model_dir, tmp_path_factory):
    return str(make_random_adapters(str(model_dir), tmp_path_factory.mktemp("lora-dp-adapter"), 1, rank=8)[0])


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


def test_a_refused_adapter_is_on_no_replica(replicas, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")   # a folder that is no PEFT adapter
    with pytest.raises(ValueError):
        run(replicas.add_lora(LoRARequest("broken", 2, str(tmp_path))))
    assert adapters_on_each_replica(replicas) == [set(), set()]
