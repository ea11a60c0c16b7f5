"""LLMEngine: add requests, step the batch forward, read outputs, abort."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.output_processor import ChildState, ParentRequest, append_token
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.stats import EngineStats, StepStats
from pagedllm.kv.manager import KVCacheManager
from pagedllm.model import kernels
from pagedllm.model.llama import CausalLM
from pagedllm.model.loader import load_checkpoint
from pagedllm.model.runner import ModelRunner, kv_bytes_per_block
from pagedllm.model.sampler import SamplerOutput
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 2**30  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

PromptType = str | dict
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt that can run: its text (if it had one), token ids, the max_tokens it gets, its cache salt."""
    text: str | None
    token_ids: list[int]
    max_tokens: int
    cache_salt: str | None


def cache_salt_of(prompt: PromptType) -> str | None:
    """vLLM's `cache_salt` prompt key: a non-empty string, or absent."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                         f"got {salt!r:.80}")
    return salt


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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.data_parallel_size > 1:   # replicas are several engines: DPAsyncLLM (pagedllm serve) runs them
            raise ValueError(f"data_parallel_size must be 1 for one LLMEngine, got {config.data_parallel_size}; "
                             "serve replicas with `pagedllm serve --data-parallel-size N`")
        self.config = config
        self.device = resolve_device(config.device)
        checkpoint = load_checkpoint(config.model, config.quantization)
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.dtype = resolve_dtype(config.dtype, checkpoint.config.torch_dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = self._resolve_max_model_len()
        model = CausalLM(checkpoint.config, checkpoint.weights, self.dtype, self.device, self.max_model_len)
        del checkpoint
        num_blocks = self._num_kv_blocks()
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, self._resolve_token_budget(),
                                   config.enable_chunked_prefill, config.scheduling_policy)
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.kv_cache_dtype, self.device,
                                  config.seed)
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, ChildState] = {}
        self.parent_of: dict[str, str] = {}
        self.pending_forks: dict[str, list[Request]] = {}   # first child's id -> siblings to fork from it
        self.last_step_stats: StepStats | None = None
        logger.info("model %s (%s) on %s, dtype %s, CPU kernels %s; KV cache: %s, %d blocks of %d tokens = %d tokens",
                    config.model or "bundled SmolLM2-135M-Instruct", self.model_config.architecture,
                    self.device, str(self.dtype).removeprefix("torch."), kernels.variant or "not built",
                    str(self.kv_cache_dtype).removeprefix("torch."), num_blocks, config.block_size,
                    num_blocks * config.block_size)
        logger.info("weights (quantization=%s): %s", config.quantization, model.weight_summary())

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len must be <= {limit} (the model's max_position_embeddings), "
                             f"got {wanted}")
        return wanted

    def _resolve_token_budget(self) -> int:
        budget = self.config.max_num_batched_tokens
        if self.config.enable_chunked_prefill:
            return budget or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if budget is not None and budget < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_model_len "
                             f"({self.max_model_len}) when enable_chunked_prefill is False")
        return budget or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)

    def _num_kv_blocks(self) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.kv_cache_dtype)
        budget = self.config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free)
        if budget is None:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {budget} bytes holds no KV block; one block of "
                             f"{self.config.block_size} tokens needs {per_block} bytes")
        return num_blocks

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and not prompt.keys() <= PROMPT_KEYS:
            raise ValueError(f"prompt keys must be among {', '.join(sorted(PROMPT_KEYS))}, "
                             f"got {', '.join(sorted(map(str, prompt.keys() - PROMPT_KEYS)))}")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            vocab = self.model_config.vocab_size
            if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt_token_ids must be a list of integers in [0, {vocab})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]} "
                         f"(either with an optional 'cache_salt'), got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validates and queues a request; raises ValueError (naming the numbers) if it can never run."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        checked = self.check_prompt(prompt, params)
        prompt_ids = checked.token_ids
        num_children = params.best_of or params.n
        arrival_time = arrival_time or time.monotonic()
        children = []
        for index in range(num_children):
            child_params = params.for_child(index) if num_children > 1 else params
            child_id = request_id if num_children == 1 else f"{index}_{request_id}"
            request = Request(child_id, prompt_ids, child_params, self.model_config.eos_token_ids,
                              checked.max_tokens, arrival_time=arrival_time, priority=priority,
                              cache_salt=checked.cache_salt)
            children.append(ChildState(request, index,
                                       IncrementalDetokenizer(self.tokenizer, prompt_ids, child_params)))
        self.parents[request_id] = ParentRequest(request_id, checked.text, prompt_ids, params, children)
        for child in children:
            self.children[child.request.request_id] = child
            self.parent_of[child.request.request_id] = request_id
        # Parallel samples share one prefill: the first child runs it, the others are forked
        # from it when it samples, taking their first tokens from the same logits.
        first = children[0].request
        self.scheduler.add_request(first)
        if num_children > 1:
            self.pending_forks[first.request_id] = [child.request for child in children[1:]]

    def check_prompt(self, prompt: PromptType, params: SamplingParams) -> CheckedPrompt:
        """Tokenizes and validates a prompt; raises ValueError naming what cannot run."""
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
        vocab = self.model_config.vocab_size
        if any(token_id >= vocab for token_id in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}, "
                             f"got {params.stop_token_ids}")
        return CheckedPrompt(text, prompt_ids, max_tokens, cache_salt)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drops requests wherever they are; their blocks return to the pool at once."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.get(request_id)
            if parent is None:
                continue
            for child in parent.children:
                if not child.request.is_finished:
                    self.finish_request(child.request, RequestStatus.FINISHED_ABORTED)
            self._forget(parent)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch; returns an output for each user request that progressed."""
        sampled_requests, samples = self.run_step()
        if samples is None:
            return []
        progressed: dict[str, ParentRequest] = {}
        token_ids = samples.token_ids.tolist()
        token_logprobs = samples.logprobs.tolist()
        top_ids = samples.top_logprob_ids.tolist() if samples.top_logprob_ids is not None else None
        top_values = samples.top_logprobs.tolist() if samples.top_logprobs is not None else None
        ranks = samples.token_ranks.tolist() if samples.token_ranks is not None else None
        for row, request in enumerate(sampled_requests):
            child = self.children[request.request_id]
            top = None
            if request.sampling_params.logprobs is not None:
                top = self._logprob_entry(token_ids[row], token_logprobs[row], ranks[row], top_ids[row],
                                          top_values[row], request.sampling_params.logprobs)
            try:
                status = append_token(child, token_ids[row], token_logprobs[row], top)
            except Exception as exc:  # one request's failure must not take the batch down
                logger.exception("request %s failed", request.request_id)
                request.error = f"{type(exc).__name__}: {exc}"
                status = RequestStatus.FINISHED_ERROR
            if status is not None:
                self.finish_request(request, status)
            parent_id = self.parent_of[request.request_id]
            progressed[parent_id] = self.parents[parent_id]
        outputs = [output for parent in progressed.values() if (output := parent.make_output()) is not None]
        for parent in progressed.values():
            if parent.finished:
                self._forget(parent)
        return outputs

    def run_step(self) -> tuple[list[Request], SamplerOutput | None]:
        """Schedules, runs the model and updates KV bookkeeping; returns who sampled what.

        The sampled tokens are not yet appended: step() and beam search each decide that.
        """
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return [], None
        if self.pending_forks:   # rare (n > 1 before its first token): skip the loop on plain steps
            for row in plan.scheduled:
                if row.samples:
                    row.also_sample_for = self.pending_forks.pop(row.request.request_id, [])
        scheduled = time.perf_counter()
        sampled_requests, samples = self.runner.execute(plan.scheduled, plan.block_copies)
        computed = time.perf_counter()
        for row in plan.scheduled:
            request = row.request
            request.num_computed_tokens += row.num_new_tokens
            self.kv_manager.cache_full_blocks(request.request_id, request.all_token_ids,
                                              request.num_computed_tokens)
            for sibling in row.also_sample_for:
                self.fork(request, sibling)
        self.last_step_stats = StepStats(
            scheduling_seconds=(scheduled - started) + (time.perf_counter() - computed),
            model_seconds=computed - scheduled,
            num_seqs=len(plan.scheduled),
            num_tokens=plan.num_scheduled_tokens,
            num_preemptions=len(plan.preempted),
        )
        return sampled_requests, samples

    def fork(self, source: Request, target: Request) -> None:
        """Starts `target` from `source`'s tokens and KV, sharing every block (copy on write)."""
        self.scheduler.fork(source, target)

    def _logprob_entry(self, token_id: int, token_logprob: float, rank: int, top_ids: list[int],
                       top_values: list[float], k: int) -> dict[int, Logprob]:
        """The sampled token's logprob and rank, plus the k most likely tokens ranked from 1."""
        decode = self.tokenizer.decode
        entry = {token_id: Logprob(token_logprob, rank, decode([token_id], skip_special_tokens=False))}
        for top_rank, (top_id, value) in enumerate(zip(top_ids[:k], top_values[:k]), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(value, top_rank, decode([top_id], skip_special_tokens=False))
        return entry

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Ends one sequence and frees its blocks at once."""
        self.scheduler.finish(request, status)
        self.runner.release(request.request_id)

    def _forget(self, parent: ParentRequest) -> None:
        del self.parents[parent.request_id]
        self.pending_forks.pop(parent.children[0].request.request_id, None)
        for child in parent.children:
            del self.children[child.request.request_id]
            del self.parent_of[child.request.request_id]

    def stats(self) -> EngineStats:
        return EngineStats(kv_cache=self.kv_manager.usage(), num_running=len(self.scheduler.running),
                           num_waiting=len(self.scheduler.waiting),
                           num_preemptions=self.scheduler.num_preemptions, last_step=self.last_step_stats)
