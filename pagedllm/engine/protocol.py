"""EngineClient: what a server needs of an engine, wherever its steps run (vLLM's engine protocol).

AsyncLLM (one engine on a thread of this process) and DPAsyncLLM (engine replicas on Ray) are the two
clients; the OpenAI/Anthropic server depends on this interface alone.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from pagedllm.engine.stats import EngineStats
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.input_processor import CheckedPrompt, PromptType
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.lora.request import LoRARequest
    from pagedllm.model.config import ModelConfig
    from pagedllm.model.pooling_checkpoint import PoolingModelInfo


class EngineRequestError(RuntimeError):
    """The engine failed this request (alone, or with its whole batch when a step raised)."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id!r} failed: {message}")
        self.request_id = request_id
        self.message = message

    def __reduce__(self):
        """Pickled with both arguments, so the error crosses process boundaries (Ray replicas) intact."""
        return type(self), (self.request_id, self.message)


class EngineDeadError(RuntimeError):
    """The engine client was shut down (or its engines died): in-flight and new requests get this."""


class EngineOverloadedError(RuntimeError):
    """max_waiting_requests are already waiting: the new request was not queued; retry later."""


class LocalEngine(ABC):
    """An engine in this process, with a way to run code on its thread between steps: how the dashboard reads
    the KV map whole."""

    engine: LLMEngine

    @abstractmethod
    async def call_in_engine_thread(self, fn: Callable, *args) -> Any:
        """fn(*args) on the engine thread, between steps."""


class EngineClient(ABC):
    """Generation and pooling streams, aborts, figures and shutdown, over one engine or many.

    The model's facts (config, tokenizer, model_config, max_model_len, pooling) are plain attributes, fixed
    once the engine is loaded; prompt checks run synchronously (a tokenizer pass and fixed limits).
    """

    config: EngineConfig
    tokenizer: Any
    model_config: ModelConfig
    max_model_len: int
    pooling: PoolingModelInfo | None   # the pooling model's facts; None for a generating model
    max_waiting_requests: int | None

    @property
    @abstractmethod
    def num_waiting_requests(self) -> int:
        """Requests accepted that have not started running."""

    def check_capacity(self, count: int = 1) -> None:
        """Raises EngineOverloadedError if `count` more requests would exceed max_waiting_requests."""
        limit, waiting = self.max_waiting_requests, self.num_waiting_requests
        if limit is not None and waiting + count > limit:
            raise EngineOverloadedError(f"{waiting} requests are waiting (the limit is {limit}); retry later")

    @abstractmethod
    def check_prompt(self, prompt: PromptType, params: SamplingParams) -> CheckedPrompt:
        """Raises ValueError naming what cannot run."""

    @abstractmethod
    def check_pooling_prompt(self, prompt: PromptType, params: PoolingParams) -> tuple[list[int], list[int]]:
        """A pooling prompt's token ids and the ids the model reads; ValueError naming what cannot run."""

    @abstractmethod
    def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                 priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them, ending after the finished one; lora_request: the
        adapter it runs with (None: the base model). Raises ValueError, EngineOverloadedError,
        EngineRequestError or EngineDeadError; closing the iterator aborts the request."""

    def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str,
               priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request's one output (vLLM's name), under generate's rules for errors and aborts."""
        return self.generate(prompt, pooling_params, request_id, priority)

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Drops the request (freeing its blocks); its stream ends quietly."""

    @abstractmethod
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads the adapter (on every engine): True if loaded now, False if it was loaded already; ValueError
        naming why it does not fit the base model."""

    @abstractmethod
    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads the adapter; LoRAInUseError while an unfinished request uses it; False if it is unknown."""

    @abstractmethod
    async def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters loaded now (on every engine)."""

    @abstractmethod
    async def stats(self) -> EngineStats:
        """The engine's figures (several engines' combined)."""

    @abstractmethod
    async def check_health(self) -> None:
        """Raises EngineDeadError once the engine cannot serve."""

    @abstractmethod
    def local_engine(self) -> LocalEngine | None:
        """The engine in this process, for the dashboard; None when the engines run elsewhere."""

    @abstractmethod
    def describe(self) -> str:
        """For the start-up log line: "(dtype D) with " where the engine runs and its KV cache."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stops the engine; in-flight requests raise EngineDeadError."""
