"""A Ray driver for test_data_parallel's two-node test: run inside the head node's network namespace.

    python data_parallel_driver.py ADDRESS MODEL_DIR PROMPTS_JSON

Joins the cluster at ADDRESS, waits until two nodes are alive, serves the prompts (greedy) on two
DPAsyncLLM replicas and prints one JSON object: the alive nodes' ids, each replica's node id, each
replica's served count and every prompt's output token ids.
"""
from __future__ import annotations

import asyncio
import json
import sys

import ray

from pagedllm import SamplingParams
from pagedllm.bench.server_process import poll
from pagedllm.config import EngineConfig
from pagedllm.engine.data_parallel import DPAsyncLLM

NODES_TIMEOUT = 120   # seconds for the worker node to join: a generous bound that fails loudly


def main(address: str, model_dir: str, prompts_json: str) -> None:
    prompts = json.loads(prompts_json)
    ray.init(address=address, logging_level="WARNING")
    alive = poll(lambda: [node["NodeID"] for node in ray.nodes() if node["Alive"]], lambda nodes: len(nodes) >= 2,
                 NODES_TIMEOUT)
    if len(alive) < 2:
        raise SystemExit(f"only {len(alive)} Ray node(s) alive after {NODES_TIMEOUT}s")
    config = EngineConfig(model=model_dir, dtype="float32", kv_cache_memory="16MiB", data_parallel_size=2)
    llm = DPAsyncLLM.from_config(config)

    async def serve():
        async def one(index, prompt):
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            outputs = [o async for o in llm.generate({"prompt_token_ids": prompt}, params, f"two-node-{index}")]
            return outputs[-1].outputs[0].token_ids

        try:
            tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            served = {index: stats.num_requests_served for index, stats in (await llm.replica_stats()).items()}
            return tokens, served
        finally:
            await llm.shutdown()

    tokens, served = asyncio.run(serve())
    print(json.dumps({"nodes": alive, "replica_nodes": [replica.info.node_id for replica in llm.replicas],
                      "served": served, "tokens": tokens}))
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
