"""LLMEngine: add requests, step the batch forward, read outputs, abort.

The composition of three parts: the InputProcessor (prompts to scheduler requests), the EngineCore
(scheduler, KV manager and executor) and the OutputProcessor (sampled tokens to RequestOutputs).
Building it loads the checkpoint and resolves the "auto" knobs (pagedllm/config/resolve.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagedllm.config import EngineConfig
from pagedllm.config.resolve import (DEFAULT_CPU_KV_CACHE_MEMORY, check_draft_vocab, check_pooling_config,
                                     chunks_prefill, resolve_device, resolve_dtype, resolve_kv_cache_dtype,
                                     resolve_lora_dtype, resolve_max_model_len, resolve_token_budget)
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.core import EngineCore
from pagedllm.engine.executor.abstract import Executor
from pagedllm.engine.executor.factory import create_executor
from pagedllm.engine.input_processor import CheckedPrompt, InputProcessor, PromptType
from pagedllm.engine.kv_setup import (kv_block_bytes, kv_blocks_in, open_kv_disk_tier, open_kv_swap_space,
                                      profiled_kv_cache_budget)
from pagedllm.engine.lora_adapters import EngineLoRAAdapters
from pagedllm.engine.model_info import ModelInfo, kv_pool_bytes
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.stats import EngineStats, StepStats
from pagedllm.kv.manager import KVCacheManager
from pagedllm.lora.request import LoRARequest
from pagedllm.model import kernels
from pagedllm.model.config import ModelConfig, kv_release_window
from pagedllm.model.loader import load_checkpoint
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.worker import WorkerArgs

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, wrap_executor: Callable[[Executor], Executor] | None = None):
        """wrap_executor: given the executor built for the config, returns the one the engine core steps (test
        tooling wraps it to fail steps or corrupt tokens on command; None: the executor itself)."""
        if config.data_parallel_size > 1:   # replicas are several engines: DPAsyncLLM (pagedllm serve) runs them
            raise ValueError(f"data_parallel_size must be 1 for one LLMEngine, got {config.data_parallel_size}; "
                             "serve replicas with `pagedllm serve --data-parallel-size N`")
        self.config = config
        self.device = resolve_device(config.device)
        checkpoint = load_checkpoint(config.model, config.quantization, config.runner, config.pooler_config,
                                     config.hf_overrides)
        self.checkpoint_source = checkpoint.source
        self.model_config = checkpoint.config
        self.pooling = checkpoint.pooling   # None: the generating runner; else the pooling model's facts
        if self.pooling is not None:
            check_pooling_config(config)
        self.tokenizer = checkpoint.tokenizer
        self.dtype = resolve_dtype(config.dtype, checkpoint.config.torch_dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype, self.dtype, self.device)
        self.max_model_len = resolve_max_model_len(config, self.model_config.context_length)
        self.draft_config = self._draft_model_config()
        token_budget = resolve_token_budget(config, self.max_model_len, self.pooling is not None)
        # On CUDA without kv_cache_memory the pool is sized after a profile run of the loaded model.
        profile = self.device.type == "cuda" and config.kv_cache_memory is None
        num_blocks = None if profile else self._kv_blocks_in(config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY)
        self.executor = create_executor(WorkerArgs(config, self.device, self.dtype, self.kv_cache_dtype,
                                                   self.max_model_len, num_blocks), checkpoint)
        if wrap_executor is not None:
            self.executor = wrap_executor(self.executor)
        del checkpoint
        self.runner = self.executor.driver_worker.model_runner   # rank 0's, for in-process tests and logs
        self.lora = EngineLoRAAdapters(self.executor, self.model_config, config.lora_config,
                                       config.tensor_parallel_size)
        if profile:
            budget = profiled_kv_cache_budget(self.executor, config, self.device,
                                              min(token_budget, self.max_model_len))
            num_blocks = self._kv_blocks_in(budget)
            self.executor.collective_rpc("allocate_kv_caches", num_blocks)
        self.kv_manager = self._kv_manager(num_blocks)
        # Rank 0 times the kernels (auto) while the other ranks wait; every rank then applies its rule.
        self.cascade = self.executor.driver_worker.choose_cascade_attention()
        self.executor.collective_rpc("use_cascade_rule", self.cascade.rule)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                         self.model_config.eos_token_ids)
        self.core = EngineCore(self.executor, self.kv_manager, config.max_num_seqs, token_budget,
                               chunks_prefill(config, self.pooling is not None), config.scheduling_policy,
                               self.structured_output, config.speculative_config,
                               config.max_loras if config.enable_lora else None, config.preemption_mode,
                               self.kv_block_bytes)
        self.scheduler = self.core.scheduler
        self.preemption = self.core.preemption   # None: every preemption recomputes
        self.step_listeners = self.core.step_listeners
        self.input_processor = InputProcessor(self.tokenizer, self.model_config, self.max_model_len,
                                              self.kv_manager, self.structured_output, self.pooling, self.lora)
        self.output_processor = OutputProcessor(self.tokenizer, self.core.finish_request)
        self.parents = self.output_processor.parents     # user requests in flight, by id
        self.children = self.output_processor.children
        self._log_start_up(num_blocks, token_budget)

    def _draft_model_config(self) -> ModelConfig | None:
        """The draft model's config for draft_model speculation; it must share the target's vocabulary."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        draft = load_checkpoint(spec.model, spec.quantization).config
        check_draft_vocab(draft.vocab_size, self.model_config.vocab_size)
        return draft

    def _kv_blocks_in(self, budget: int) -> int:
        return kv_blocks_in(budget, self.config, self.model_config, self.draft_config, self.kv_cache_dtype)

    def _kv_manager(self, num_blocks: int) -> KVCacheManager:
        config = self.config
        disk_tier = root_hash = None
        if config.kv_cache_dir:
            if self.pooling is not None:
                raise ValueError("kv_cache_dir keeps prefix-cache blocks, which pooling models do not use")
            disk_tier, root_hash = open_kv_disk_tier(self.executor, config, self.model_config,
                                                     self.checkpoint_source, self.dtype, self.kv_cache_dtype)
        # Pooling prompts run whole in one step (nothing computed is ever preempted, so no swap space) and never
        # reuse cached blocks (an encoder's K/V depend on later tokens).
        swap_space = None if self.pooling is not None else open_kv_swap_space(self.executor, config, disk_tier,
                                                                               self.kv_block_bytes)
        window = kv_release_window([self.model_config, *filter(None, [self.draft_config])], self.max_model_len)
        return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching and self.pooling is None,
                              window, config.max_pinned_kv_cache_fraction, disk_tier=disk_tier, root_hash=root_hash,
                              swap_space=swap_space)

    @property
    def kv_block_bytes(self) -> int:
        """One KV block's bytes on one rank: what a swap or a disk file moves."""
        return kv_block_bytes(self.config, self.model_config, self.kv_cache_dtype)

    def _log_start_up(self, num_blocks: int, token_budget: int) -> None:
        config, model = self.config, self.runner.model
        logger.info("model %s (%s) on %s, dtype %s, attention backend %s, CPU kernels %s, cascade attention %s; "
                    "KV cache: %s, %d blocks of %d tokens = %d tokens",
                    config.model or "bundled SmolLM2-135M-Instruct", self.model_config.architecture,
                    self.device, str(self.dtype).removeprefix("torch."), self.runner.attention_backend.describe(),
                    kernels.variant or "not built", self.cascade.describe(),
                    str(self.kv_cache_dtype).removeprefix("torch."), num_blocks, config.block_size,
                    num_blocks * config.block_size)
        logger.info("weights (quantization=%s): %s", config.quantization, model.weight_summary())
        if model.has_quantized_layers:
            logger.info("quantized matmuls (%s activations): %s", str(self.dtype).removeprefix("torch."),
                        model.matmul.describe(self.dtype))
        if config.speculative_config is not None:
            logger.info("speculative decoding: %s", config.speculative_config)
        self.lora.log_start(resolve_lora_dtype(config.lora_dtype, config.dtype, self.dtype, self.device))
        if self.pooling is not None:
            logger.info("pooling runner: %s pooling, normalize %s, %s; prompts run whole (up to %d tokens a step), "
                        "prefix caching off", self.pooling.pooler.pooling_type, self.pooling.pooler.normalize,
                        f"cross-encoder with {self.pooling.num_labels} label(s)" if self.pooling.is_cross_encoder
                        else "embeddings", token_budget)

    def check_prompt(self, prompt: PromptType, params: SamplingParams | BeamSearchParams) -> CheckedPrompt:
        """Tokenizes and validates a prompt; raises ValueError naming what cannot run."""
        return self.input_processor.check_prompt(prompt, params)

    def check_pooling_prompt(self, prompt: PromptType, params: PoolingParams) -> tuple[list[int], list[int]]:
        """A pooling request's token ids, and the ids the model reads; ValueError naming what cannot run."""
        return self.input_processor.check_pooling_prompt(prompt, params)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | PoolingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """Validates and queues a request, sampled, (with BeamSearchParams) beam-searched or (with PoolingParams)
        pooled; raises ValueError (naming the numbers) if it can never run. lora_request: the adapter it runs
        with (loaded now if it is not yet); None: the base model."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        new = self.input_processor.process(request_id, prompt, params, arrival_time or time.monotonic(), priority,
                                           lora_request)
        self.output_processor.add(new.parent)
        self.core.add_request(new.first, new.siblings)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads the adapter on every rank now, checked against the base (ValueError naming the reason); True if
        loaded now, False if an adapter with its lora_int_id was loaded already."""
        return self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads the adapter; LoRAInUseError while an unfinished request uses it; False if it is unknown."""
        return self.lora.remove(lora_int_id, list(self.scheduler.requests.values()))

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters loaded now."""
        return self.lora.list()

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drops requests wherever they are; their blocks return to the pool at once."""
        self.core.abort_requests(self.output_processor.abort([request_ids] if isinstance(request_ids, str)
                                                             else request_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Runs one scheduled batch; returns an output for each user request that progressed."""
        return self.output_processor.process(self.core.step())

    def model_info(self) -> ModelInfo:
        """The loaded model's facts (weights, KV pool, dtypes, backend) for benchmarks and tools."""
        runner, kv = self.runner, self.kv_manager
        return ModelInfo(self.model_config.architecture, str(self.dtype).removeprefix("torch."),
                         str(self.kv_cache_dtype).removeprefix("torch."), runner.attention_backend.name,
                         runner.model.weight_bytes(), runner.model.weight_summary(), kv_pool_bytes(runner.kv_caches),
                         kv.pool.num_blocks, kv.block_size, self.cascade)

    @property
    def last_step_stats(self) -> StepStats | None:
        return self.core.last_step_stats

    def stats(self) -> EngineStats:
        return self.core.stats()

    def flush_kv_disk_tier(self) -> None:
        """Returns once every block spilled so far is written (tests, and a clean shutdown)."""
        self.core.flush_kv_disk_tier()

    def shutdown(self) -> None:
        """Stops the executor's worker processes (tensor parallel); also done when the engine is freed."""
        self.core.shutdown()
        self.structured_output.shutdown()
