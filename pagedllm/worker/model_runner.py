"""Turns a step's plain data into flat tensors, runs the model once, samples one token per finishing row.

The runner keeps the running requests in a persistent InputBatch, changed by what each step says
changed; it never sees the scheduler's request objects.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from pagedllm.model.attention import AttentionMetadata, CacheTensor, has_scales, kv_cache_shapes, kv_scales_shape
from pagedllm.model.attention_backends import select_attention_backend
from pagedllm.model.cascade import find_shared_prefixes
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import CausalLM
from pagedllm.model.tensor_parallel import num_kv_heads_per_rank
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.structured_output.bitmask import apply_grammar_bitmask
from pagedllm.worker.host_staging import HostStaging, fetch
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.prompt_logprobs import PromptLogprobsPlan, compute_prompt_logprobs
from pagedllm.worker.sampler import SamplingBatch, sample


SCALE_BYTES = 4   # one float32 scale per slot and kv head, for the caches that have them


def kv_bytes_per_block(config: ModelConfig, block_size: int, cache_dtype: torch.dtype,
                       tensor_parallel_size: int = 1) -> int:
    """K and V of every layer for one block of tokens, in the KV cache dtype (scales included), on one
    rank: each tensor-parallel rank caches its own KV heads only."""
    bytes_per_head = config.head_dim * cache_dtype.itemsize + (SCALE_BYTES if has_scales(cache_dtype) else 0)
    num_kv_heads = num_kv_heads_per_rank(config, tensor_parallel_size)
    return 2 * config.num_hidden_layers * block_size * num_kv_heads * bytes_per_head


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On CPU it comes from calloc (via numpy), so the OS hands out
    zero pages only as blocks are first written, and start-up need not touch gigabytes.
    Zeros matter: masked-out slots of a gathered block still enter the attention matmul."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, cache_dtype: torch.dtype,
                       device: torch.device, num_kv_heads: int | None = None) -> list[tuple[CacheTensor, CacheTensor]]:
    """Every layer's zeroed K and V caches in cache_dtype, laid out as kv_cache_shapes says, scales included;
    num_kv_heads: a tensor-parallel rank's (default: all the model's)."""
    num_kv_heads = num_kv_heads or config.num_key_value_heads
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, num_kv_heads, config.head_dim)
    scales_shape = kv_scales_shape(num_blocks, block_size, num_kv_heads)

    def new_cache(shape: tuple[int, ...]) -> CacheTensor:
        scales = _zeros(scales_shape, torch.float32, device) if has_scales(cache_dtype) else None
        return CacheTensor(_zeros(shape, cache_dtype, device), scales)
    return [(new_cache(k_shape), new_cache(v_shape)) for _ in range(config.num_hidden_layers)]


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int | None, block_size: int, kv_cache_dtype: torch.dtype,
                 device: torch.device, seed: int, max_model_len: int, max_num_seqs: int,
                 attention_backend: str = "auto", dtype: torch.dtype = torch.float32,
                 enable_cascade_attention: bool = False):
        """num_blocks None: the caches are allocated later (allocate_kv_caches), once a profile run has
        measured what the model leaves free. attention_backend: an EngineConfig value, resolved here once."""
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.vocab_size = config.vocab_size
        self.kv_cache_dtype = kv_cache_dtype
        self.attention_backend = select_attention_backend(attention_backend, device, config.head_dim, block_size,
                                                          dtype, kv_cache_dtype)
        self.kv_caches: list[tuple[CacheTensor, CacheTensor]] = []
        if num_blocks is not None:
            self.allocate_kv_caches(num_blocks)
        self.input_batch = InputBatch(max_model_len, block_size, device, capacity=max_num_seqs)
        self.staging = HostStaging(device)
        # The cascade kernel is C++ only.
        self.use_cascade = enable_cascade_attention and self.attention_backend.uses_cpu_kernels
        torch.manual_seed(seed)

    def allocate_kv_caches(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.model.config, num_blocks, self.block_size, self.kv_cache_dtype,
                                            self.device, self.model.num_kv_heads)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> int:
        """Runs the largest step the scheduler can make (num_tokens prompt tokens, logits and sampling for
        num_seqs rows) against a scratch cache just large enough, and returns the peak bytes the device's
        allocator held meanwhile, the scratch cache's excluded (0 off CUDA, where nothing is measured)."""
        num_blocks = -(-num_tokens // self.block_size)
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        scratch = allocate_kv_caches(self.model.config, num_blocks, self.block_size, self.kv_cache_dtype,
                                     self.device, self.model.num_kv_heads)
        scratch_bytes = sum(t.nbytes for layer in scratch for cache in layer
                            for t in (cache.data, cache.scales) if t is not None)
        meta, positions, _ = self.attention_metadata(np.arange(num_blocks)[None], np.zeros(1, np.int64),
                                                     np.array([num_tokens]))
        logits_indices = torch.full((num_seqs,), num_tokens - 1, device=self.device)
        logits = self.model(torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
                            self.staging.to_device("positions", positions), scratch, meta, logits_indices)
        if logits is not None:   # the sampler's own buffers: a softmax and a sort over the vocabulary per row
            logits.softmax(-1).sort(dim=-1)
        if not on_cuda:
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - scratch_bytes

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Updates the batch, makes the copy-on-write block copies, runs one forward pass, and samples."""
        started = time.perf_counter()
        batch = self.input_batch
        batch.update(scheduler_output)
        if scheduler_output.block_copies:
            self._copy_blocks(scheduler_output.block_copies)
        if not scheduler_output.num_scheduled_tokens:   # a step that only drops finished or preempted requests
            return ModelRunnerOutput([], [], [], prepare_seconds=time.perf_counter() - started)
        input_ids, positions, meta, logits_indices, sampling_rows, prompt_plan = self._prepare(scheduler_output)
        prepared = time.perf_counter()
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
        if logits is None:   # tensor-parallel ranks > 0 get no logits: rank 0 samples
            return ModelRunnerOutput([], [], [], prepare_seconds=prepared - started)
        prompt_logprobs = None
        if prompt_plan is not None:   # their rows come after the sampling rows
            prompt_logprobs = compute_prompt_logprobs(logits[len(sampling_rows):], prompt_plan)
            logits = logits[:len(sampling_rows)]
        if not len(sampling_rows):
            return ModelRunnerOutput([], [], [], prepare_seconds=prepared - started, prompt_logprobs=prompt_logprobs)
        req_ids = [batch.req_ids[row] for row in sampling_rows.tolist()]
        if scheduler_output.grammar_bitmask is not None:
            logits = self._apply_grammar_bitmask(logits, req_ids, scheduler_output)
        sampling = SamplingBatch.build(batch.sampling, sampling_rows, batch.token_ids,
                                       batch.num_prompt_tokens[sampling_rows], batch.num_tokens[sampling_rows],
                                       self.vocab_size, self.device)
        samples = sample(logits, sampling)
        token_ids, logprobs, top_ids, top_logprobs, ranks = fetch(
            [samples.token_ids, samples.logprobs, samples.top_logprob_ids, samples.top_logprobs, samples.token_ranks])
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=token_ids,
            logprobs=logprobs,
            top_logprob_ids=top_ids,
            top_logprobs=top_logprobs,
            token_ranks=ranks,
            prepare_seconds=prepared - started,
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str], scheduler_output: SchedulerOutput
                               ) -> torch.Tensor:
        """Structured outputs: the rows with a grammar may sample only what it allows next."""
        logits_row = {request_id: index for index, request_id in enumerate(req_ids)}
        rows = [logits_row[request_id] for request_id in scheduler_output.grammar_request_ids]
        return apply_grammar_bitmask(logits, scheduler_output.grammar_bitmask, rows)

    def _copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        sources, destinations = (self.staging.to_device(name, np.array(ids))
                                 for name, ids in zip(("copy_sources", "copy_destinations"), zip(*block_copies)))
        for layer in self.kv_caches:
            for cache in layer:
                cache.copy_blocks(sources, destinations)

    def _shared_prefixes(self, block_tables: np.ndarray, context: np.ndarray, num_decodes: int) -> dict:
        """The cascade groups among the step's decodes and among its prefill chunks (none when switched off)."""
        if not self.use_cascade:
            return {}
        return {"decode_cascade": find_shared_prefixes(block_tables[:num_decodes], context[:num_decodes],
                                                       self.block_size),
                "prefill_cascade": find_shared_prefixes(block_tables[num_decodes:], context[num_decodes:],
                                                        self.block_size)}

    def _prepare(self, scheduler_output: SchedulerOutput):
        """Ids, positions, slot mapping and block tables for the step's rows by array ops on the batch; the
        batch rows that sample, in the order of the logits rows; and the rows prompt logprobs add after them."""
        batch, staging = self.input_batch, self.staging
        rows, num_new = batch.step_rows(scheduler_output)
        max_blocks = int(batch.num_blocks[rows].max())
        meta, positions, token_row = self.attention_metadata(batch.block_table[rows, :max_blocks],
                                                             batch.num_computed_tokens[rows], num_new)
        input_ids = batch.token_ids[rows[token_row], positions].astype(np.int64)
        sampling_rows, logits_indices = batch.sampling_rows(rows, num_new, scheduler_output)
        prompt_plan = PromptLogprobsPlan.for_step(batch.sampling.num_prompt_logprobs, batch.req_ids, rows, num_new,
                                                  batch.num_computed_tokens, batch.num_prompt_tokens, batch.token_ids)
        if prompt_plan is not None:
            logits_indices = np.concatenate([logits_indices, prompt_plan.token_indices])
        return (staging.to_device("input_ids", input_ids), staging.to_device("positions", positions), meta,
                staging.to_device("logits_indices", logits_indices), sampling_rows, prompt_plan)

    def attention_metadata(self, block_tables: np.ndarray, context: np.ndarray, num_new: np.ndarray
                           ) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
        """The attention layout of rows (decodes, one new token each, first) with `context` tokens cached
        and `num_new` new ones, their blocks in block_tables; and each new token's position and row."""
        block_size, staging = self.block_size, self.staging
        row_ends = np.cumsum(num_new)
        row_starts = row_ends - num_new
        num_tokens = int(row_ends[-1])
        token_row = np.repeat(np.arange(len(num_new)), num_new)
        positions = np.arange(num_tokens) - row_starts[token_row] + context[token_row]
        slot_mapping = block_tables[token_row, positions // block_size] * block_size + positions % block_size

        num_decodes = int((num_new == 1).sum())
        seq_lens = context + num_new
        decode_blocks = -(-int(seq_lens[:num_decodes].max()) // block_size) if num_decodes else 0
        tables = staging.to_device("block_tables", block_tables)
        query_starts = staging.to_device("query_starts", np.append(row_starts, num_tokens))
        device_seq_lens = staging.to_device("seq_lens", seq_lens)
        meta = AttentionMetadata(
            slot_mapping=staging.to_device("slot_mapping", slot_mapping),
            num_decode_tokens=num_decodes,
            decode_block_tables=tables[:num_decodes, :decode_blocks].contiguous(),
            decode_seq_lens=device_seq_lens[:num_decodes],
            prefill_query_starts=query_starts[num_decodes:],
            prefill_context_lens=staging.to_device("context_lens", context[num_decodes:]),
            prefill_block_tables=tables[num_decodes:],
            block_size=block_size,
            use_kernel=self.attention_backend.uses_cpu_kernels,
            query_starts=query_starts,
            seq_lens=device_seq_lens,
            block_tables=tables,
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            backend=self.attention_backend,
            **self._shared_prefixes(block_tables, context, num_decodes),
        )
        return meta, positions, token_row
