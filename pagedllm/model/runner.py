"""Turns a scheduled step into flat tensors, runs the model once, samples one token per finishing row."""
from __future__ import annotations

import math

import numpy as np
import torch

from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import ScheduledRequest
from pagedllm.model.attention import (AttentionMetadata, CacheTensor, has_scales, kernel_available, kv_cache_shapes,
                                      kv_scales_shape)
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import CausalLM
from pagedllm.model.sampler import SamplerOutput, SamplingBatch, sample
from pagedllm.model.tensor_parallel import num_kv_heads_per_rank


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
                 device: torch.device, seed: int):
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.vocab_size = config.vocab_size
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, kv_cache_dtype, device, model.num_kv_heads)
        self.generators: dict[str, torch.Generator] = {}
        self.use_kernel = kernel_available(device, config.head_dim)
        torch.manual_seed(seed)

    def release(self, request_id: str) -> None:
        """Forgets a finished request's random generator."""
        self.generators.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self.generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[request.request_id] = generator
        return generator

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], block_copies: list[tuple[int, int]] = ()
                ) -> tuple[list[Request], SamplerOutput | None]:
        """Makes the copy-on-write block copies, runs one forward pass, and samples.

        Returns the requests that sampled and their samples, row for row; on tensor-parallel ranks
        other than 0, which get no logits, ([], None): sampling happens on rank 0 only.
        """
        if block_copies:
            self._copy_blocks(block_copies)
        rows = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta, logits_indices = self._prepare(rows)
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
        sampling_rows = [r for row in rows if row.samples for r in (row.request, *row.also_sample_for)]
        if logits is None or not sampling_rows:
            return [], None
        batch = SamplingBatch.build(
            params=[r.sampling_params for r in sampling_rows],
            prompt_token_ids=[r.prompt_token_ids for r in sampling_rows],
            output_token_ids=[r.output_token_ids for r in sampling_rows],
            eos_token_ids=[r.eos_token_ids for r in sampling_rows],
            generators=[self._generator(r) for r in sampling_rows],
            vocab_size=self.vocab_size,
            device=self.device,
        )
        return sampling_rows, sample(logits, batch)

    def _copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        sources, destinations = (torch.tensor(ids, device=self.device) for ids in zip(*block_copies))
        for layer in self.kv_caches:
            for cache in layer:
                cache.copy_blocks(sources, destinations)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def _prepare(self, rows: list[ScheduledRequest]):
        """Builds ids, positions, slot mapping and block tables with array ops, not per token."""
        block_size = self.block_size
        num_new = np.array([row.num_new_tokens for row in rows], dtype=np.int64)
        context = np.array([row.request.num_computed_tokens for row in rows], dtype=np.int64)
        row_ends = np.cumsum(num_new)
        row_starts = row_ends - num_new
        num_tokens = int(row_ends[-1])
        token_row = np.repeat(np.arange(len(rows)), num_new)
        positions = np.arange(num_tokens) - row_starts[token_row] + context[token_row]

        max_blocks = max(len(row.block_table) for row in rows)
        block_tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
        for i, row in enumerate(rows):
            block_tables[i, :len(row.block_table)] = row.block_table
        slot_mapping = block_tables[token_row, positions // block_size] * block_size + positions % block_size

        input_ids = np.fromiter(
            (t for row in rows for t in row.request.all_token_ids[
                row.request.num_computed_tokens:row.request.num_computed_tokens + row.num_new_tokens]),
            dtype=np.int64, count=num_tokens)
        samples_per_row = np.array([(1 + len(row.also_sample_for)) * row.samples for row in rows])
        logits_indices = np.repeat(row_ends - 1, samples_per_row)

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
        )
        return self._to_device(input_ids), self._to_device(positions), meta, self._to_device(logits_indices)
