"""One engine replica for data parallelism: an AsyncLLM with its own step loop, run as a Ray actor.

The class is plain Python; data_parallel.py makes it a Ray actor (`ray.remote(EngineReplica)`)
so this module imports no Ray at import time. The actor is async: its event loop serves every
call concurrently while the AsyncLLM steps the engine on its own thread. A request's outputs
stream back through a Ray streaming generator; an error the engine raises for a request travels
as the stream's last item (an exception object), so the front raises the very same error. For prefix-aware
routing a replica reports the block hashes its prefix cache and disk tier gained and lost since its last report
(block_hash_report), which the front asks for as it routes a request.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.dp_router import BlockHashReport
from pagedllm.engine.input_processor import CheckedPrompt, PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import EngineStats
from pagedllm.lora.request import LoRAInUseError, LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ReplicaInfo:
    """What the front needs to know of a loaded replica."""
    node_id: str          # the Ray node it runs on
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    dtype: str            # torch dtype name, e.g. "float32"
    # The root of its KV manager's block-hash chains (the process's, or its kv_cache_dir's): a secret the router
    # needs to hash prompts into the same chains. Never printed.
    block_hash_root: bytes = field(repr=False)


@dataclass(frozen=True)
class ReplicaStats:
    engine: EngineStats
    num_requests_served: int   # requests this replica finished (with an answer) since it started


class EngineReplica:
    def __init__(self, config: EngineConfig, num_threads: int | None = None):
        """With data_parallel_routing prefix, its KV tiers record the block hashes they gain and lose."""
        # Inside a replica the engine runs alone (its tensor parallel workers, if any, as mp subprocesses).
        config = dataclasses.replace(config, data_parallel_size=1, distributed_executor_backend="mp")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.llm = AsyncLLM(LLMEngine(config))
        self.num_requests_served = 0
        self._hash_log = None
        self._reporting = asyncio.Lock()   # one report at a time: the log has one drainer
        if config.data_parallel_routing == "prefix":
            kv = self.llm.engine.kv_manager
            # Past twice what the tiers can hold, a snapshot is smaller than the events.
            capacity = kv.pool.num_blocks + (kv.disk.capacity_blocks if kv.disk is not None else 0)
            self._hash_log = kv.tiers.publish_block_hashes(max_events=2 * capacity)

    def info(self) -> ReplicaInfo:
        import ray

        engine = self.llm.engine
        kv = engine.stats().kv_cache   # nothing runs yet: safe to read off the engine thread
        return ReplicaInfo(node_id=ray.get_runtime_context().get_node_id(), max_model_len=engine.max_model_len,
                           num_kv_blocks=kv.num_blocks, block_size=kv.block_size,
                           dtype=str(engine.dtype).removeprefix("torch."),
                           block_hash_root=engine.kv_manager.root_hash)

    def check_prompt(self, prompt: PromptType, params: SamplingParams) -> CheckedPrompt | ValueError:
        """The engine's own check (tokenizer and fixed limits only, so no step can disturb it); a refusal
        is returned, not raised, so the caller gets the ValueError itself rather than Ray's wrapper."""
        try:
            return self.llm.engine.check_prompt(prompt, params)
        except ValueError as exc:
            return exc

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput | Exception]:
        """AsyncLLM.generate's outputs; a failure is yielded as the last item instead of raised."""
        try:
            async for output in self.llm.generate(prompt, params, request_id, priority, lora_request=lora_request):
                if output.finished:
                    self.num_requests_served += 1
                yield output
        except Exception as exc:   # ValueError, EngineRequestError, EngineDeadError...: the caller's to raise
            yield exc

    async def add_lora(self, lora_request: LoRARequest) -> bool | ValueError:
        """AsyncLLM.add_lora; a refused adapter's ValueError is returned, as check_prompt returns its own."""
        try:
            return await self.llm.add_lora(lora_request)
        except ValueError as exc:
            return exc

    async def remove_lora(self, lora_int_id: int) -> bool | LoRAInUseError:
        """AsyncLLM.remove_lora; the LoRAInUseError of an adapter still in use is returned, not raised."""
        try:
            return await self.llm.remove_lora(lora_int_id)
        except LoRAInUseError as exc:
            return exc

    async def list_loras(self) -> set[int]:
        return await self.llm.list_loras()

    async def block_hash_report(self) -> BlockHashReport:
        """The block hashes its tiers gained and lost since the last report; the whole state (read between two
        steps) at the first report and whenever the log overflowed."""
        async with self._reporting:
            events = self._hash_log.drain()
            if events is not None:
                return BlockHashReport(events)
            snapshot = await self.llm.call_in_engine_thread(self.llm.engine.kv_manager.tiers.block_hash_snapshot)
            return BlockHashReport(self._hash_log.drain() or [], snapshot)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def stats(self) -> ReplicaStats:
        return ReplicaStats(await self.llm.stats(), self.num_requests_served)

    async def shutdown(self) -> None:
        await self.llm.shutdown()
