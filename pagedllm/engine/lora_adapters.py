"""The engine's side of multi-LoRA serving: adapters checked and loaded on every rank, refused while in use, named in
the stats, and kept apart in the prefix cache.

The workers hold the adapters themselves (pagedllm/lora/worker_manager.py); this keeps what the engine must know
to admit a request: which adapters have been checked against the base, and which unfinished requests use which.
"""
from __future__ import annotations

import logging

import torch

from pagedllm.config.lora import LoRAConfig
from pagedllm.engine.executor.abstract import Executor
from pagedllm.engine.request import Request
from pagedllm.lora.peft_checkpoint import load_peft_adapter
from pagedllm.lora.request import LoRAInUseError, LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.step import SchedulerOutput

logger = logging.getLogger(__name__)


def lora_cache_salt(cache_salt: str | None, lora_request: LoRARequest | None) -> str | None:
    """The salt under which a request's KV blocks are cached: an adapter's blocks are its own (its K/V differ from
    the base's and every other adapter's for the same tokens), and requests of one adapter share them."""
    if lora_request is None:
        return cache_salt
    identity = f"lora\x00{lora_request.lora_int_id}\x00{lora_request.lora_name}\x00{lora_request.lora_path}"
    return identity if cache_salt is None else f"{cache_salt}\x00{identity}"


class EngineLoRAAdapters:
    def __init__(self, executor: Executor, model_config: ModelConfig, lora_config: LoRAConfig | None,
                 tensor_parallel_size: int):
        self.executor = executor
        self.model_config = model_config
        self.config = lora_config
        self.tensor_parallel_size = tensor_parallel_size
        self.checked: dict[int, LoRARequest] = {}   # adapters checked against the base, by lora_int_id

    def check_request(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter: refused if LoRA is off or it is not a LoRARequest; loaded on first use."""
        if lora_request is None:
            return
        if self.config is None:
            raise ValueError("lora_request names an adapter, but this engine runs without LoRA: start it with "
                             "enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if lora_request.lora_int_id not in self.checked:
            self.add(lora_request)

    def add(self, lora_request: LoRARequest) -> bool:
        """Loads and checks the adapter on every rank; True if it was loaded now, False if it was loaded already."""
        if self.config is None:
            raise ValueError("add_lora needs an engine started with enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.tensor_parallel_size > 1:
            # A rank that fails a call ends the engine: the adapter is checked here first, where failing is harmless.
            load_peft_adapter(lora_request, self.model_config, self.config)
        loaded = self.executor.collective_rpc("add_lora", lora_request)
        self.checked[lora_request.lora_int_id] = lora_request
        return loaded

    def remove(self, lora_id: int, unfinished: list[Request]) -> bool:
        """Unloads the adapter everywhere; LoRAInUseError while an unfinished request uses it; False if unknown."""
        if self.config is None:
            return False
        users = [request.request_id for request in unfinished
                 if request.lora_request is not None and request.lora_request.lora_int_id == lora_id]
        if users:
            raise LoRAInUseError(f"LoRA adapter {lora_id} is in use by {len(users)} unfinished request(s) "
                                 f"(such as {users[0]!r}); remove it once they finish or are aborted")
        known = self.checked.pop(lora_id, None) is not None
        return self.executor.collective_rpc("remove_lora", lora_id) or known

    def list(self) -> set[int]:
        """The adapters loaded in memory now (at most max_cpu_loras)."""
        return set() if self.config is None else self.executor.collective_rpc("list_loras")

    def log_start(self, dtype: torch.dtype) -> None:
        """dtype: what the workers hold the adapters in (lora_dtype resolved)."""
        if self.config is not None:
            logger.info("LoRA on: max_loras %d per step, max_lora_rank %d, max_cpu_loras %d, adapters in %s "
                        "(lora_dtype %s)", self.config.max_loras, self.config.max_lora_rank, self.config.max_cpu_loras,
                        str(dtype).removeprefix("torch."), self.config.lora_dtype)


def adapters_in_step(scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> int:
    """Distinct adapters among the step's requests."""
    return len({request.lora_request.lora_int_id for request_id in scheduler_output.num_scheduled_tokens
                if (request := requests.get(request_id)) is not None and request.lora_request is not None})


def adapter_names(requests: list[Request]) -> tuple[str, ...]:
    """The distinct adapters of these requests, by name, sorted (vLLM's lora_requests_info labels)."""
    return tuple(sorted({request.lora_request.lora_name for request in requests if request.lora_request is not None}))
