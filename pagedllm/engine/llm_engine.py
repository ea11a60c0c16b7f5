"""LLMEngine: add requests, step the batch forward, read outputs, abort."""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.bad_words import bad_words_token_ids
from pagedllm.engine.beam_search import BeamSearch, BeamSearchParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.executor.abstract import Executor
from pagedllm.engine.lora_adapters import EngineLoRAAdapters, adapter_names, lora_cache_salt
from pagedllm.engine.output_processor import BeamSearchParent, ChildState, ParentRequest, process_token
from pagedllm.engine.pooling import PoolingParent, check_pooling_params, check_token_type_ids
from pagedllm.engine.preemption import PreemptionPolicy
from pagedllm.engine.request import CachePin, Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.stats import EngineStats, KVDiskStats, KVSwapStats, StepStats
from pagedllm.kv.disk_tier import DiskTier
from pagedllm.kv.manager import KVCacheManager
from pagedllm.lora.request import LoRARequest
from pagedllm.kv.swap import SwapSpace
from pagedllm.model import kernels
from pagedllm.model.config import ModelConfig, kv_release_window
from pagedllm.model.loader import load_checkpoint
from pagedllm.model.bert import with_token_types
from pagedllm.model.rope_scaling import rope_length_key
from pagedllm.outputs import Logprob, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.planner import SpeculationPlanner
from pagedllm.step import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import Tokenizer
from pagedllm.worker.kv_disk_store import HEADER_BYTES, weights_fingerprint
from pagedllm.worker.model_runner import kv_bytes_per_block
from pagedllm.worker.worker import WorkerArgs

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 2**30  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
KV_DISK_FORMAT = 1   # of kv_cache_dir's block files; a directory of another format is refused

PromptType = str | dict
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "cache_pins"})
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt that can run: its text (if it had one), token ids, the max_tokens it gets, its cache salt and
    the prefixes it pins."""
    text: str | None
    token_ids: list[int]
    max_tokens: int
    cache_salt: str | None
    cache_pins: tuple[CachePin, ...] = ()


def cache_salt_of(prompt: PromptType) -> str | None:
    """vLLM's `cache_salt` prompt key: a non-empty string, or absent."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                         f"got {salt!r:.80}")
    return salt


def tokenize_prompt(prompt: PromptType, tokenizer: Tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """A prompt's text (if it has one) and token ids; ValueError naming what is wrong with it."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict) and not prompt.keys() <= PROMPT_KEYS:
        raise ValueError(f"prompt keys must be among {', '.join(sorted(PROMPT_KEYS))}, "
                         f"got {', '.join(sorted(map(str, prompt.keys() - PROMPT_KEYS)))}")
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be a list of integers in [0, {vocab_size})")
        return prompt.get("prompt"), list(ids)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"], tokenizer.encode(prompt["prompt"])
    raise ValueError("prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]} "
                     f"(either with an optional 'cache_salt' and 'cache_pins'), got {type(prompt).__name__}")


def prefix_cache_salt(cache_salt: str | None, model_config: ModelConfig, num_prompt_tokens: int,
                      max_model_len: int) -> str | None:
    """The key a prompt's first KV block is cached under beside its tokens: the request's cache salt, and for
    K/V that depend on the prompt's length (some rope scalings) that length's key, so they are shared only
    at that length."""
    rope_key = rope_length_key(model_config.rope_scaling, num_prompt_tokens, max_model_len)
    return cache_salt if rope_key is None else f"{cache_salt or ''}\x00{rope_key}"


def cache_pins_of(prompt: PromptType, num_prompt_tokens: int, enable_prefix_caching: bool) -> tuple[CachePin, ...]:
    """The `cache_pins` prompt key: CachePins within the prompt, with a positive, finite ttl_s."""
    pins = prompt.get("cache_pins") if isinstance(prompt, dict) else None
    if not pins:
        return ()
    if not enable_prefix_caching:
        raise ValueError("cache_pins keep prefixes in the prefix cache, which this engine runs without "
                         "(enable_prefix_caching=False)")
    if not isinstance(pins, (list, tuple)) or not all(isinstance(pin, CachePin) for pin in pins):
        raise ValueError(f"cache_pins must be a list of CachePin, got {pins!r:.80}")
    for pin in pins:
        if not (isinstance(pin.num_tokens, int) and 0 <= pin.num_tokens <= num_prompt_tokens):
            raise ValueError(f"cache_pins: num_tokens must be an integer from 0 to the prompt's {num_prompt_tokens} "
                             f"tokens, got {pin.num_tokens!r}")
        if not (isinstance(pin.ttl_s, (int, float)) and 0 < pin.ttl_s < math.inf):
            raise ValueError(f"cache_pins: ttl_s must be a positive number of seconds, got {pin.ttl_s!r}")
    return tuple(pins)


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_fast_bfloat16() -> bool:
    """AMX or AVX-512-BF16: bfloat16 matmuls run several times faster than float32 here."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """What "auto" means: on a CPU with fast bfloat16, bfloat16; on other CPUs, float32 (float16
    is slow there); on CUDA, the checkpoint's own dtype (float32 for dequantized GGUF files)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_fast_bfloat16() else torch.float32
    if checkpoint_dtype in ("bfloat16", "float16"):
        return getattr(torch, checkpoint_dtype)
    return torch.float32


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: "auto" is the model dtype; fp8_e5m2 (vLLM's name) is torch.float8_e5m2;
    int8 caches also keep a float32 scale per token and kv head."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else getattr(torch, kv_cache_dtype)


def gpu_kv_cache_budget(total: int, utilization: float, peak_torch: int, non_torch: int) -> int:
    """Bytes the KV cache may take on a GPU of `total` bytes: the engine's share (utilization), less what the
    profile run showed the engine needs besides: the peak of its tensors (weights, activations, sampler)
    and the memory torch does not manage (CUDA context, NCCL, other processes on the device)."""
    budget = int(total * utilization) - peak_torch - non_torch
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} gives the engine {int(total * utilization)} of "
                         f"{total} bytes, but the profile run needs {peak_torch} bytes of tensors and {non_torch} "
                         f"bytes outside torch already: no room for a KV cache; raise gpu_memory_utilization")
    return budget


class LLMEngine:
    def __init__(self, config: EngineConfig):
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
            self._check_pooling_engine()
        self.tokenizer = checkpoint.tokenizer
        self.dtype = resolve_dtype(config.dtype, checkpoint.config.torch_dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = self._resolve_max_model_len()
        self.draft_config = self._check_draft_model()
        # On CUDA without kv_cache_memory the pool is sized after a profile run of the loaded model.
        profile = self.device.type == "cuda" and config.kv_cache_memory is None
        num_blocks = None if profile else self._num_kv_blocks(config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY)
        self.executor = Executor.create(WorkerArgs(config, self.device, self.dtype, self.kv_cache_dtype,
                                                   self.max_model_len, num_blocks), checkpoint)
        del checkpoint
        self.runner = self.executor.driver_worker.model_runner   # rank 0's
        self.lora = EngineLoRAAdapters(self.executor, self.model_config, config.lora_config,
                                       config.tensor_parallel_size)
        model = self.runner.model
        token_budget = self._resolve_token_budget()
        if profile:
            num_blocks = self._num_kv_blocks(self._profiled_kv_cache_budget(token_budget))
            self.executor.collective_rpc("allocate_kv_caches", num_blocks)
        disk_tier, root_hash = self._open_kv_disk_tier() if config.kv_cache_dir else (None, None)
        swap_space = self._open_kv_swap_space(disk_tier)
        self.preemption = PreemptionPolicy(config.preemption_mode) if swap_space is not None else None
        # Pooling prompts run whole and never reuse cached blocks (an encoder's K/V depend on later tokens).
        self.kv_manager = KVCacheManager(num_blocks, config.block_size,
                                         config.enable_prefix_caching and self.pooling is None,
                                         kv_release_window([self.model_config, *filter(None, [self.draft_config])],
                                                           self.max_model_len),
                                         config.max_pinned_kv_cache_fraction, disk_tier=disk_tier, root_hash=root_hash,
                                         swap_space=swap_space)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                         self.model_config.eos_token_ids)
        speculation = SpeculationPlanner(config.speculative_config) if config.speculative_config else None
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, token_budget, self._chunks_prefill,
                                   config.scheduling_policy, self.structured_output, speculation,
                                   config.max_loras if config.enable_lora else None, self.preemption)
        self.parents: dict[str, ParentRequest | BeamSearchParent | PoolingParent] = {}
        self.children: dict[str, ChildState] = {}   # plain and parallel samples (not beams) by request id
        self.parent_of: dict[str, str] = {}
        self.beam_searches: list[BeamSearchParent] = []
        self.last_step_stats: StepStats | None = None
        # Called on the engine thread with each step's StepStats (the dashboard subscribes while a page is open).
        self.step_listeners: list[Callable[[StepStats], None]] = []
        logger.info("model %s (%s) on %s, dtype %s, attention backend %s, CPU kernels %s, cascade attention %s; "
                    "KV cache: %s, %d blocks of %d tokens = %d tokens",
                    config.model or "bundled SmolLM2-135M-Instruct", self.model_config.architecture,
                    self.device, str(self.dtype).removeprefix("torch."), self.runner.attention_backend.name,
                    kernels.variant or "not built", "on" if self.runner.use_cascade else "off",
                    str(self.kv_cache_dtype).removeprefix("torch."), num_blocks, config.block_size,
                    num_blocks * config.block_size)
        logger.info("weights (quantization=%s): %s", config.quantization, model.weight_summary())
        if model.has_quantized_layers:
            logger.info("quantized matmuls (%s activations): %s", str(self.dtype).removeprefix("torch."),
                        model.matmul.describe(self.dtype))
        if config.speculative_config is not None:
            logger.info("speculative decoding: %s", config.speculative_config)
        self.lora.log_start()
        if self.pooling is not None:
            logger.info("pooling runner: %s pooling, normalize %s, %s; prompts run whole (up to %d tokens a step), "
                        "prefix caching off", self.pooling.pooler.pooling_type, self.pooling.pooler.normalize,
                        f"cross-encoder with {self.pooling.num_labels} label(s)" if self.pooling.is_cross_encoder
                        else "embeddings", token_budget)

    @property
    def _chunks_prefill(self) -> bool:
        """Pooling prompts are computed whole, in one step: the pooler (and an encoder's attention) sees them entire."""
        return self.config.enable_chunked_prefill and self.pooling is None

    def _check_pooling_engine(self) -> None:
        if self.config.enable_lora:
            raise ValueError("enable_lora applies to generating models; this is a pooling model")
        if self.config.speculative_config is not None:
            raise ValueError("speculative_config applies to generation; a pooling model generates nothing")
        if self.config.tensor_parallel_size > 1:
            raise ValueError(f"pooling models run with tensor_parallel_size 1, got {self.config.tensor_parallel_size}")

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.context_length
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len must be <= {limit} (the model's context: max_position_embeddings, "
                             f"times the factor of dynamic rope scaling), got {wanted}")
        return wanted

    def _resolve_token_budget(self) -> int:
        budget = self.config.max_num_batched_tokens
        if self._chunks_prefill:
            return budget or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if budget is not None and budget < self.max_model_len:
            reason = "for a pooling model (its prompts run whole)" if self.pooling else "when enable_chunked_prefill is False"
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_model_len "
                             f"({self.max_model_len}) {reason}")
        return budget or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)

    def _check_draft_model(self) -> ModelConfig | None:
        """The draft model's config for draft_model speculation; it must share the target's vocabulary."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        draft = load_checkpoint(spec.model, spec.quantization).config
        if draft.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config.model must have the target's vocabulary ({self.model_config.vocab_size} "
                             f"tokens, the same tokenizer), got a draft model with {draft.vocab_size}")
        return draft

    def _open_kv_disk_tier(self) -> tuple[DiskTier, bytes]:
        """Opens kv_cache_dir (refused if made for another model or cache layout) and indexes its blocks."""
        if self.pooling is not None:
            raise ValueError("kv_cache_dir keeps prefix-cache blocks, which pooling models do not use")
        model = self.model_config
        identity = {"format": KV_DISK_FORMAT, "weights": weights_fingerprint(self.checkpoint_source),
                    "architecture": model.architecture, "dtype": str(self.dtype).removeprefix("torch."),
                    "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
                    "block_size": self.config.block_size, "num_hidden_layers": model.num_hidden_layers,
                    "num_key_value_heads": model.num_key_value_heads, "head_dim": model.head_dim}
        root_hash, entries = self.executor.collective_rpc("open_kv_disk_tier", identity)
        file_bytes = HEADER_BYTES + self.kv_block_bytes
        disk_tier = DiskTier(self.config.kv_cache_disk_bytes // file_bytes, entries)
        logger.info("KV disk tier: %s, %d of %d blocks (%d bytes each) found", self.config.kv_cache_dir,
                    len(disk_tier), disk_tier.capacity_blocks, file_bytes)
        return disk_tier, root_hash

    def _open_kv_swap_space(self, disk_tier: DiskTier | None) -> SwapSpace | None:
        """Room for preempted requests' blocks unless preemption_mode is recompute: the disk tier's quota, else
        swap_space of RAM (None when that holds no block: then every preemption recomputes)."""
        config = self.config
        if config.preemption_mode == "recompute" or self.pooling is not None:
            return None   # pooling prompts run whole in one step: nothing computed is ever preempted
        if disk_tier is not None:
            swap_space = SwapSpace(0, disk_tier)
        else:
            capacity = config.swap_space_bytes // self.kv_block_bytes
            if capacity == 0:
                return None
            swap_space = SwapSpace(capacity)
        self.executor.collective_rpc("open_kv_swap_space")
        logger.info("preemption %s: swapped blocks go to %s (room for %d blocks)", config.preemption_mode,
                    config.kv_cache_dir or f"{config.swap_space} GiB of RAM", swap_space.capacity_blocks)
        return swap_space

    @property
    def kv_block_bytes(self) -> int:
        """One KV block's bytes on one rank: what a swap or a disk file moves."""
        return kv_bytes_per_block(self.model_config, self.config.block_size, self.kv_cache_dtype,
                                  self.config.tensor_parallel_size)

    def flush_kv_disk_tier(self) -> None:
        """Returns once every block spilled so far is written (tests, and a clean shutdown)."""
        if self.config.kv_cache_dir:
            self.executor.collective_rpc("flush_kv_disk_tier")

    def _profiled_kv_cache_budget(self, token_budget: int) -> int:
        """Runs the largest step on every rank and sizes the KV cache from rank 0's device by what it showed."""
        num_tokens = min(token_budget, self.max_model_len)
        peak = self.executor.collective_rpc("profile_run", num_tokens, min(self.config.max_num_seqs, num_tokens))
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = gpu_kv_cache_budget(total, self.config.gpu_memory_utilization, peak, non_torch)
        logger.info("profile run of %d tokens: peak %.2f GiB of tensors, %.2f GiB outside torch; KV cache gets "
                    "%.2f GiB of the %.2f GiB that gpu_memory_utilization=%s allows", num_tokens, peak / 2**30,
                    non_torch / 2**30, budget / 2**30, total * self.config.gpu_memory_utilization / 2**30,
                    self.config.gpu_memory_utilization)
        return budget

    def _num_kv_blocks(self, budget: int) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.kv_cache_dtype,
                                       self.config.tensor_parallel_size)   # per rank, as kv_cache_memory
        draft = self.draft_config
        if draft is not None:   # the draft's KV pool has as many blocks, under the same ids, in the same budget
            per_block += kv_bytes_per_block(draft, self.config.block_size, self.kv_cache_dtype)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {budget} bytes holds no KV block; one block of "
                             f"{self.config.block_size} tokens needs {per_block} bytes")
        return num_blocks

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(prompt, self.tokenizer, self.model_config.vocab_size)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | PoolingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """Validates and queues a request, sampled, (with BeamSearchParams) beam-searched or (with PoolingParams)
        pooled; raises ValueError (naming the numbers) if it can never run. lora_request: the adapter it runs
        with (loaded now if it is not yet); None: the base model."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival_time = arrival_time or time.monotonic()
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request applies to generation, not to pooling requests")
            self._add_pooling_request(request_id, prompt, params, arrival_time, priority)
            return
        checked = self.check_prompt(prompt, params)
        self.lora.check_request(lora_request)
        checked = dataclasses.replace(checked, cache_salt=lora_cache_salt(checked.cache_salt, lora_request))
        if isinstance(params, BeamSearchParams):
            search = BeamSearch(request_id, checked.token_ids, params, self.model_config.eos_token_ids,
                                checked.max_tokens, checked.cache_salt, arrival_time, priority, lora_request)
            search.first_request.cache_pins = checked.cache_pins
            parent = BeamSearchParent(request_id, checked.text, checked.token_ids, search, self.tokenizer)
            self.parents[request_id] = parent
            self.beam_searches.append(parent)
            self.scheduler.add_request(search.first_request)
            return
        prompt_ids = checked.token_ids
        if params.bad_words:   # the caller's params stay as they are: each request gets its own copy
            sequences = [*(params.bad_words_token_ids or ()), *bad_words_token_ids(self.tokenizer, params.bad_words)]
            params = dataclasses.replace(params, bad_words_token_ids=sequences)
        num_children = params.best_of or params.n
        children = []
        for index in range(num_children):
            child_params = params.for_child(index) if num_children > 1 else params
            child_id = request_id if num_children == 1 else f"{index}_{request_id}"
            request = Request(child_id, prompt_ids, child_params, self.model_config.eos_token_ids,
                              checked.max_tokens, arrival_time=arrival_time, priority=priority,
                              cache_salt=checked.cache_salt, cache_pins=checked.cache_pins, lora_request=lora_request)
            if params.structured_outputs is not None:
                request.grammar = self.structured_output.request_grammar(params.structured_outputs)
            children.append(ChildState(request, index,
                                       IncrementalDetokenizer(self.tokenizer, prompt_ids, child_params)))
        self.parents[request_id] = ParentRequest(request_id, checked.text, prompt_ids, params, children)
        for child in children:
            self.children[child.request.request_id] = child
            self.parent_of[child.request.request_id] = request_id
        # Parallel samples share one prefill: the first child runs it, the others are forked
        # from it when it samples, taking their first tokens from the same logits.
        self.scheduler.add_request(children[0].request, [child.request for child in children[1:]])

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams, arrival_time: float,
                             priority: int) -> None:
        token_ids, model_token_ids = self.check_pooling_prompt(prompt, params)
        request = Request(request_id, model_token_ids, SamplingParams(), (), max_tokens=1, arrival_time=arrival_time,
                          priority=priority)
        self.parents[request_id] = PoolingParent(request, token_ids, params, self.pooling)
        self.scheduler.add_request(request)

    def check_pooling_prompt(self, prompt: PromptType, params: PoolingParams) -> tuple[list[int], list[int]]:
        """A pooling request's token ids, and the ids the model reads (an encoder's carry their token types);
        ValueError naming what cannot run."""
        check_pooling_params(params, self.pooling)
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict):
            cache_salt_of(prompt)
            if prompt.get("cache_pins"):
                raise ValueError("cache_pins apply to generation: a pooling prompt is computed whole and never "
                                 "reuses cached blocks")
            prompt = {key: value for key, value in prompt.items()
                      if key not in ("token_type_ids", "cache_salt", "cache_pins")}
        token_ids = self._tokenize(prompt)[1]
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}")
        if not self.kv_manager.can_ever_fit(len(token_ids)):
            raise ValueError(f"the prompt's {len(token_ids)} tokens need more KV blocks than the whole cache has "
                             f"({self.kv_manager.pool.num_blocks} blocks of {self.kv_manager.block_size}); raise "
                             "kv_cache_memory")
        if token_type_ids is None:
            return token_ids, token_ids
        return token_ids, with_token_types(token_ids, check_token_type_ids(token_type_ids, len(token_ids),
                                                                             self.pooling))

    def check_prompt(self, prompt: PromptType, params: SamplingParams | BeamSearchParams) -> CheckedPrompt:
        """Tokenizes and validates a prompt; raises ValueError naming what cannot run."""
        if self.pooling is not None:
            raise ValueError("this is a pooling model: it embeds or scores (LLM.embed / LLM.score, /v1/embeddings, "
                             "/v1/score, /v1/rerank) and cannot generate text")
        cache_salt = cache_salt_of(prompt)
        text, prompt_ids = self._tokenize(prompt)
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}: no room to generate")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = "
                             f"{len(prompt_ids) + max_tokens} exceeds max_model_len ({self.max_model_len})")
        total = len(prompt_ids) + max_tokens
        if not self.kv_manager.can_ever_fit(total):
            raise ValueError(f"prompt + max_tokens = {total} tokens need more KV blocks than the whole "
                             f"cache has ({self.kv_manager.pool.num_blocks} blocks of "
                             f"{self.kv_manager.block_size}); raise kv_cache_memory")
        if isinstance(params, SamplingParams):
            self._check_token_ids(params)
        cache_salt = prefix_cache_salt(cache_salt, self.model_config, len(prompt_ids), self.max_model_len)
        cache_pins = cache_pins_of(prompt, len(prompt_ids), self.kv_manager.enable_prefix_caching)
        return CheckedPrompt(text, prompt_ids, max_tokens, cache_salt, cache_pins)

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids the params name must be in the vocabulary."""
        vocab = self.model_config.vocab_size
        bad_word_ids = [token_id for word in params.bad_words_token_ids or () for token_id in word]
        for name, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                                ("allowed_token_ids", params.allowed_token_ids or ()),
                                ("bad_words_token_ids", bad_word_ids)):
            outside = [token_id for token_id in token_ids if token_id >= vocab]
            if outside:
                raise ValueError(f"{name} must name token ids below the vocabulary size {vocab}, got {outside[:10]}")

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
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.get(request_id)
            if parent is None:
                continue
            for request in parent.unfinished_requests():
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self._forget(parent)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch; returns an output for each user request that progressed."""
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        failed, self.scheduler.failed_requests = self.scheduler.failed_requests, []
        if not scheduler_output.has_work:
            if failed:
                return self._process_outputs([], None, failed)
            self._wait_for_grammars()
            return []
        num_loras = self.lora.count_in_step(scheduler_output, self.scheduler.requests)
        scheduled = time.perf_counter()
        runner_output = self.executor.execute_model(scheduler_output)
        computed = time.perf_counter()
        sampled = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.prompt_logprobs:
            self._store_prompt_logprobs(runner_output.prompt_logprobs)
        updated = time.perf_counter()
        outputs = self._process_outputs(sampled, runner_output, failed)
        if runner_output.pooler_output:
            outputs += self._pooled_outputs(runner_output.pooler_output)
        self.last_step_stats = StepStats(
            scheduling_seconds=(scheduled - started) + (updated - computed),
            prepare_seconds=runner_output.prepare_seconds,
            model_seconds=computed - scheduled - runner_output.prepare_seconds,
            num_seqs=len(scheduler_output.num_scheduled_tokens),
            num_tokens=scheduler_output.total_num_scheduled_tokens,
            num_preemptions=len(scheduler_output.preempted_req_ids),
            block_copies=scheduler_output.block_copies,
            num_loras=num_loras,
        )
        if self.preemption is not None:
            self._observe_preemption_costs(scheduler_output, runner_output)
        for listener in self.step_listeners:
            listener(self.last_step_stats)
        return outputs

    def _observe_preemption_costs(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Feeds preemption_mode auto the step's measured costs: seconds per prefill token (a step of mostly
        prefill tokens) and seconds per swapped block copied."""
        step, work = self.last_step_stats, scheduler_output.disk_work
        self.preemption.observe_swap(len(work.swap_outs) + len(work.swap_ins), runner_output.kv_swap_seconds)
        if step.num_tokens >= 2 * step.num_seqs:
            self.preemption.observe_prefill(step.num_tokens, step.model_seconds - runner_output.kv_swap_seconds)

    def _wait_for_grammars(self, timeout: float = 0.05) -> None:
        """Nothing could run: if requests wait for their grammars to compile, wait for one rather than spin."""
        compiling = [request.grammar for request in self.scheduler.waiting if request.grammar is not None]
        if compiling:
            self.structured_output.wait_for_compiles(compiling, timeout)

    def _process_outputs(self, sampled: list[tuple[Request, int]], runner_output: ModelRunnerOutput | None,
                         failed: list[Request] = ()) -> list[RequestOutput]:
        """Detokenizes the appended tokens, applies stop strings, and makes the user requests' outputs
        (also of the requests that failed before running)."""
        progressed: dict[str, ParentRequest | BeamSearchParent] = {}
        for request in failed:
            parent_id = self.parent_of[request.request_id]
            progressed[parent_id] = self.parents[parent_id]
        ended_here: set[str] = set()   # finished by a stop string or an error at a token of this step
        for request, row in sampled:
            if request.request_id in ended_here:
                # A speculative step gave it more tokens than it keeps: drop those after the end.
                request.all_token_ids.pop()
                request.cumulative_logprob -= runner_output.logprobs[row]
                continue
            try:
                if self._process_token(request, runner_output, row):
                    ended_here.add(request.request_id)
            except Exception as exc:  # one request's failure must not take the batch down
                logger.exception("request %s failed", request.request_id)
                request.error = f"{type(exc).__name__}: {exc}"
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
                ended_here.add(request.request_id)
            parent_id = self.parent_of[request.request_id]
            progressed[parent_id] = self.parents[parent_id]
        for parent in [parent for parent in self.beam_searches if parent.finished]:
            progressed[parent.request_id] = parent
        outputs = [output for parent in progressed.values() if (output := parent.make_output()) is not None]
        for parent in progressed.values():
            if parent.finished:
                self._forget(parent)
        return outputs

    def _process_token(self, request: Request, runner_output: ModelRunnerOutput, row: int) -> bool:
        """Takes in one appended token; True when it completed a stop string, which ends the request."""
        child = self.children[request.request_id]
        token_id = runner_output.sampled_token_ids[row]
        top = None
        if request.sampling_params.logprobs is not None:
            top = self._logprob_entry(token_id, runner_output.logprobs[row], runner_output.token_ranks[row],
                                      runner_output.top_logprob_ids[row], runner_output.top_logprobs[row],
                                      request.sampling_params.logprobs)
        stop_string = process_token(child, token_id, top)
        if stop_string is not None:   # ends the request even if max_tokens did in the same token
            request.stop_reason = stop_string
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            return True
        return False

    def _store_prompt_logprobs(self, chunks: dict[str, PromptLogprobs]) -> None:
        """Hands each request's share of the step's prompt logprobs to its user request, as Logprob entries."""
        for request_id, chunk in chunks.items():
            parent = self.parents.get(self.parent_of.get(request_id))
            if parent is None:   # aborted since the step was scheduled
                continue
            positions = range(chunk.first_position, chunk.first_position + len(chunk.token_logprobs))
            entries = [self._logprob_entry(parent.prompt_token_ids[position], *values, parent.params.prompt_logprobs)
                       for position, *values in zip(positions, chunk.token_logprobs, chunk.token_ranks,
                                                    chunk.top_ids, chunk.top_logprobs)]
            parent.add_prompt_logprobs(chunk.first_position, entries)

    def _logprob_entry(self, token_id: int, token_logprob: float, rank: int, top_ids: list[int],
                       top_values: list[float], k: int) -> dict[int, Logprob]:
        """The token's logprob and rank, plus the k most likely tokens ranked from 1 (sampled or prompt tokens)."""
        decode = self.tokenizer.decode
        entry = {token_id: Logprob(token_logprob, rank, decode([token_id], skip_special_tokens=False))}
        for top_rank, (top_id, value) in enumerate(zip(top_ids[:k], top_values[:k]), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(value, top_rank, decode([top_id], skip_special_tokens=False))
        return entry

    def _pooled_outputs(self, pooled: dict) -> list[PoolingRequestOutput]:
        """The pooling requests the step finished (the scheduler freed their blocks), each with its result."""
        outputs = []
        for request_id, row in pooled.items():
            parent = self.parents.get(request_id)
            if parent is None:   # aborted since the step was scheduled
                continue
            parent.take(row)
            outputs.append(parent.make_output())
            self._forget(parent)
        return outputs

    def _forget(self, parent: ParentRequest | BeamSearchParent | PoolingParent) -> None:
        del self.parents[parent.request_id]
        if isinstance(parent, PoolingParent):
            return
        if isinstance(parent, BeamSearchParent):
            self.beam_searches.remove(parent)
            return
        for child in parent.children:
            del self.children[child.request.request_id]
            del self.parent_of[child.request.request_id]

    def shutdown(self) -> None:
        """Stops the executor's worker processes (tensor parallel); also done when the engine is freed."""
        self.flush_kv_disk_tier()
        self.executor.shutdown()
        self.structured_output.shutdown()

    def stats(self) -> EngineStats:
        return EngineStats(kv_cache=self.kv_manager.usage(), num_running=len(self.scheduler.running),
                           num_waiting=len(self.scheduler.waiting),
                           num_preemptions=self.scheduler.num_preemptions, last_step=self.last_step_stats,
                           spec_decoding=spec.snapshot() if (spec := self.scheduler.spec_decoding_stats) else None,
                           kv_disk=self._kv_disk_stats(), kv_swap=self._kv_swap_stats(),
                           running_lora_adapters=adapter_names(self.scheduler.running),
                           waiting_lora_adapters=adapter_names(self.scheduler.waiting),
                           max_lora=self.config.max_loras if self.config.enable_lora else 0)

    def _kv_disk_stats(self) -> KVDiskStats | None:
        disk = self.kv_manager.disk
        if disk is None:
            return None
        bytes_read, bytes_written, stale_files_removed = self.executor.collective_rpc("kv_disk_bytes_moved")
        counters = disk.counters
        return KVDiskStats(len(disk), disk.capacity_blocks, counters.hits, counters.read_failures, counters.spills,
                           counters.evictions, bytes_read, bytes_written, stale_files_removed)

    def _kv_swap_stats(self) -> KVSwapStats | None:
        swap = self.kv_manager.swap
        if swap is None:
            return None
        counters, block_bytes = swap.counters, self.kv_block_bytes
        return KVSwapStats(swap.tier, swap.capacity_blocks, swap.num_blocks, counters.swap_outs, counters.swap_ins,
                           counters.blocks_out, counters.blocks_in, counters.blocks_reused,
                           counters.blocks_out * block_bytes,
                           counters.blocks_in * block_bytes, counters.refused, counters.failed_blocks,
                           self.preemption.counters.recomputed)
