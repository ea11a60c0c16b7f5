"""One engine replica for data parallelism: an AsyncLLM with its own step loop, run as a Ray actor.

The class is plain Python; data_parallel.py makes it a Ray actor (`ray.remote(EngineReplica)`)
so this module imports no Ray at import time. The actor is async: its event loop serves every
call concurrently while the AsyncLLM steps the engine on its own thread. A request's outputs
stream back through a Ray streaming generator; an error the engine raises for a request travels
as the stream's last item (an exception object), so the front raises the very same error.
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.input_processor import CheckedPrompt, PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import EngineStats
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


@dataclass(frozen=True)
class ReplicaStats:
    engine: EngineStats
    num_requests_served: int   # requests this replica finished (with an answer) since it started


class EngineReplica:
    def __init__(self, config: EngineConfig, num_threads: int | None = None):
        # Inside a replica the engine runs alone (its tensor parallel workers, if any, as mp subprocesses).
        config = dataclasses.replace(config, data_parallel_size=1, distributed_executor_backend="mp")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.llm = AsyncLLM(LLMEngine(config))
        self.num_requests_served = 0

    def info(self) -> ReplicaInfo:
        import ray

        engine = self.llm.engine
        kv = engine.stats().kv_cache   # nothing runs yet: safe to read off the engine thread
        return ReplicaInfo(node_id=ray.get_runtime_context().get_node_id(), max_model_len=engine.max_model_len,
                           num_kv_blocks=kv.num_blocks, block_size=kv.block_size,
                           dtype=str(engine.dtype).removeprefix("torch."))

    def check_prompt(self, prompt: PromptType, params: SamplingParams) -> CheckedPrompt | ValueError:
        """The engine's own check (tokenizer and fixed limits only, so no step can disturb it); a refusal
        is returned, not raised, so the caller gets the ValueError itself rather than Ray's wrapper."""
        try:
            return self.llm.engine.check_prompt(prompt, params)
        except ValueError as exc:
            return exc

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput | Exception]:
        """AsyncLLM.generate's outputs; a failure is yielded as the last item instead of raised."""
        try:
            async for output in self.llm.generate(prompt, params, request_id, priority):
                if output.finished:
                    self.num_requests_served += 1
                yield output
        except Exception as exc:   # ValueError, EngineRequestError, EngineDeadError...: the caller's to raise
            yield exc

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def stats(self) -> ReplicaStats:
        return ReplicaStats(await self.llm.stats(), self.num_requests_served)

    async def shutdown(self) -> None:
        await self.llm.shutdown()
