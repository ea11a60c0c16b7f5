"""Turns a step's plain data into flat tensors, runs the model once, samples one token per finishing row.

The runner keeps the running requests in a persistent InputBatch, changed by what each step says
changed; it never sees the scheduler's request objects.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from pagedllm.model.attention import (AttentionMetadata, CacheTensor, has_scales, kernel_available, kv_cache_shapes,
                                      kv_scales_shape)
from pagedllm.model.cascade import find_shared_prefixes
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import CausalLM
from pagedllm.model.tensor_parallel import num_kv_heads_per_rank
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.input_batch import InputBatch
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
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype,
                 device: torch.device, seed: int, max_model_len: int, max_num_seqs: int,
                 enable_cascade_attention: bool = False):
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.vocab_size = config.vocab_size
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, kv_cache_dtype, device,
                                            model.num_kv_heads)
        self.input_batch = InputBatch(max_model_len, block_size, device, capacity=max_num_seqs)
        self.use_kernel = kernel_available(device, config.head_dim)
        self.use_cascade = enable_cascade_attention and self.use_kernel   # the cascade kernel is C++ only
        torch.manual_seed(seed)

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
        input_ids, positions, meta, logits_indices, sampling_rows = self._prepare(scheduler_output)
        prepared = time.perf_counter()
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
        if logits is None or not len(sampling_rows):   # tensor-parallel ranks > 0 get no logits: rank 0 samples
            return ModelRunnerOutput([], [], [], prepare_seconds=prepared - started)
        sampling = SamplingBatch.build(batch.sampling, sampling_rows, batch.token_ids,
                                       batch.num_prompt_tokens[sampling_rows], batch.num_tokens[sampling_rows],
                                       self.vocab_size, self.device)
        samples = sample(logits, sampling)
        top_ids = samples.top_logprob_ids
        return ModelRunnerOutput(
            req_ids=[batch.req_ids[row] for row in sampling_rows.tolist()],
            sampled_token_ids=samples.token_ids.tolist(),
            logprobs=samples.logprobs.tolist(),
            top_logprob_ids=None if top_ids is None else top_ids.tolist(),
            top_logprobs=None if top_ids is None else samples.top_logprobs.tolist(),
            token_ranks=None if top_ids is None else samples.token_ranks.tolist(),
            prepare_seconds=prepared - started,
        )

    def _copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        sources, destinations = (torch.tensor(ids, device=self.device) for ids in zip(*block_copies))
        for layer in self.kv_caches:
            for cache in layer:
                cache.copy_blocks(sources, destinations)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def _shared_prefixes(self, block_tables: np.ndarray, context: np.ndarray, num_decodes: int) -> dict:
        """The cascade groups among the step's decodes and among its prefill chunks (none when switched off)."""
        if not self.use_cascade:
            return {}
        return {"decode_cascade": find_shared_prefixes(block_tables[:num_decodes], context[:num_decodes],
                                                       self.block_size),
                "prefill_cascade": find_shared_prefixes(block_tables[num_decodes:], context[num_decodes:],
                                                        self.block_size)}

    def _prepare(self, scheduler_output: SchedulerOutput):
        """Ids, positions, slot mapping and block tables for the step's rows by array ops on the batch; and
        the batch rows that sample, in the order of the logits rows."""
        batch, block_size = self.input_batch, self.block_size
        rows, num_new = batch.step_rows(scheduler_output)
        context = batch.num_computed_tokens[rows]
        row_ends = np.cumsum(num_new)
        row_starts = row_ends - num_new
        num_tokens = int(row_ends[-1])
        token_row = np.repeat(np.arange(len(rows)), num_new)
        positions = np.arange(num_tokens) - row_starts[token_row] + context[token_row]

        max_blocks = int(batch.num_blocks[rows].max())
        block_tables = batch.block_table[rows, :max_blocks]
        slot_mapping = block_tables[token_row, positions // block_size] * block_size + positions % block_size
        input_ids = batch.token_ids[rows[token_row], positions].astype(np.int64)
        sampling_rows, logits_indices = batch.sampling_rows(rows, num_new, scheduler_output)

        num_decodes = int((num_new == 1).sum())
        seq_lens = context + num_new
        decode_blocks = -(-int(seq_lens[:num_decodes].max()) // block_size) if num_decodes else 0
        tables = self._to_device(block_tables)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            num_decode_tokens=num_decodes,
            decode_block_tables=tables[:num_decodes, :decode_blocks].contiguous(),
            decode_seq_lens=self._to_device(seq_lens[:num_decodes]),
            prefill_query_starts=self._to_device(np.append(row_starts[num_decodes:], num_tokens)),
            prefill_context_lens=self._to_device(context[num_decodes:]),
            prefill_block_tables=tables[num_decodes:],
            block_size=block_size,
            use_kernel=self.use_kernel,
            **self._shared_prefixes(block_tables, context, num_decodes),
        )
        return (self._to_device(input_ids), self._to_device(positions), meta, self._to_device(logits_indices),
                sampling_rows)
