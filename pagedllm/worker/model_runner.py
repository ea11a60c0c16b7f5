"""Turns a step's plain data into flat tensors, runs the model once, samples one token per finishing row.

The runner keeps the running requests in a persistent InputBatch, changed by what each step says
changed; it never sees the scheduler's request objects.

A speculating request's proposals (the scheduler's n-gram ones, or the draft model's, made here first)
are written after its last token, so it computes 1 + k rows as a short chunk after its cached context;
logits come back for all of them and the rejection sampler keeps the accepted prefix and one more token.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.model.attention import CacheTensor, has_scales, kernel_available, kv_cache_shapes, kv_scales_shape
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import CausalLM
from pagedllm.model.tensor_parallel import num_kv_heads_per_rank
from pagedllm.spec_decode.rejection_sampler import Proposal, verify
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.sampler import SamplerOutput, SamplingBatch, choose_tokens, sample, summarise
from pagedllm.worker.step_layout import build_layout, to_device


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


def copy_blocks(kv_caches: list[tuple[CacheTensor, CacheTensor]], block_copies: list[tuple[int, int]],
                device: torch.device) -> None:
    """Copies whole blocks (source, destination) in every layer's caches: copy on write."""
    sources, destinations = (torch.tensor(ids, device=device) for ids in zip(*block_copies))
    for layer in kv_caches:
        for cache in layer:
            cache.copy_blocks(sources, destinations)


@dataclass
class SpecRows:
    """The step's speculating requests: their batch rows, proposals, and the draft's distributions."""
    rows: np.ndarray
    token_ids: list[list[int]]
    draft_probs: list[torch.Tensor | None]


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype,
                 device: torch.device, seed: int, max_model_len: int, max_num_seqs: int, drafter=None):
        """drafter: a DraftModelProposer (pagedllm/spec_decode/draft_model.py) for draft-model speculation."""
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.vocab_size = config.vocab_size
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, kv_cache_dtype, device,
                                            model.num_kv_heads)
        self.input_batch = InputBatch(max_model_len, block_size, device, capacity=max_num_seqs)
        self.use_kernel = kernel_available(device, config.head_dim)
        self.drafter = drafter
        torch.manual_seed(seed)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Updates the batch, makes the copy-on-write block copies, runs one forward pass, and samples."""
        started = time.perf_counter()
        batch = self.input_batch
        batch.update(scheduler_output)
        if self.drafter is not None:
            self.drafter.update(scheduler_output)
        if scheduler_output.block_copies:
            copy_blocks(self.kv_caches, scheduler_output.block_copies, self.device)
        if not scheduler_output.num_scheduled_tokens:   # a step that only drops finished or preempted requests
            return ModelRunnerOutput([], [], [], prepare_seconds=time.perf_counter() - started)
        drafting_started = time.perf_counter()
        spec = self._propose(scheduler_output) if scheduler_output.num_spec_tokens else None
        drafting_seconds = time.perf_counter() - drafting_started   # the draft model's passes: model time
        input_ids, positions, meta, logits_indices, sampling_rows = self._prepare(scheduler_output, spec)
        prepared = time.perf_counter()
        prepare_seconds = prepared - started - drafting_seconds
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
        if logits is None or not len(logits_indices):   # tensor-parallel ranks > 0 get no logits: rank 0 samples
            return ModelRunnerOutput([], [], [], prepare_seconds=prepare_seconds)
        sampling = SamplingBatch.build(batch.sampling, sampling_rows, batch.token_ids,
                                       batch.num_prompt_tokens[sampling_rows], batch.num_tokens[sampling_rows],
                                       self.vocab_size, self.device)
        req_ids = [batch.req_ids[row] for row in sampling_rows.tolist()]
        if spec is None:
            samples = sample(logits, sampling)
        else:
            samples = self._verify(logits, sampling, spec, req_ids)
        top_ids = samples.top_logprob_ids
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=samples.token_ids.tolist(),
            logprobs=samples.logprobs.tolist(),
            top_logprob_ids=None if top_ids is None else top_ids.tolist(),
            top_logprobs=None if top_ids is None else samples.top_logprobs.tolist(),
            token_ranks=None if top_ids is None else samples.token_ranks.tolist(),
            prepare_seconds=prepare_seconds,
        )

    def _propose(self, scheduler_output: SchedulerOutput) -> SpecRows:
        """The speculating requests' proposals (the scheduler's, or the draft model's), written after each
        one's last token in the batch, where the step's input ids are read from."""
        batch = self.input_batch
        num_spec_tokens, given = scheduler_output.num_spec_tokens, scheduler_output.spec_token_ids
        rows = np.fromiter(map(batch.row_of.__getitem__, num_spec_tokens), np.int64, len(num_spec_tokens))
        token_ids: list[list[int]] = [given.get(request_id) for request_id in num_spec_tokens]
        draft_probs: list[torch.Tensor | None] = [None] * len(rows)
        to_draft = [index for index, tokens in enumerate(token_ids) if tokens is None]
        if to_draft:
            if self.drafter is None:
                raise RuntimeError("the step asks for draft-model proposals but no draft model is loaded")
            counts = np.fromiter((num_spec_tokens[batch.req_ids[rows[index]]] for index in to_draft), np.int64)
            drafted, probs = self.drafter.propose(batch, rows[to_draft], counts)
            for index, tokens, row_probs in zip(to_draft, drafted, probs):
                token_ids[index], draft_probs[index] = tokens, row_probs
        for row, tokens in zip(rows.tolist(), token_ids):
            start = batch.num_tokens[row]
            batch.token_ids[row, start:start + len(tokens)] = tokens
        return SpecRows(rows, token_ids, draft_probs)

    def _verify(self, logits: torch.Tensor, sampling: SamplingBatch, spec: SpecRows, req_ids: list[str]
                ) -> SamplerOutput:
        """Samples the plain rows (the first len(req_ids) logits rows) and verifies the speculating ones
        (1 + k rows each, after them); appends each speculating request's id to req_ids once per token it
        gets. Returns the tokens of both, in that order, with their logprobs."""
        batch = self.input_batch
        num_plain = len(req_ids)
        plain_ids = (choose_tokens(logits[:num_plain], sampling)[0] if num_plain
                     else torch.empty(0, dtype=torch.int64, device=self.device))
        counts = np.fromiter(map(len, spec.token_ids), np.int64, len(spec.rows)) + 1
        rows = np.repeat(spec.rows, counts)
        offsets = np.cumsum(counts) - counts
        num_tokens = batch.num_tokens[rows] + np.arange(len(rows)) - np.repeat(offsets, counts)
        verifying = SamplingBatch.build(batch.sampling, rows, batch.token_ids, batch.num_prompt_tokens[rows],
                                        num_tokens, self.vocab_size, self.device)
        columns = batch.sampling
        proposals = [Proposal(int(first), tokens, probs, bool(columns.greedy[row]),
                              columns.generators[row] if columns.seeded[row] else None)
                     for first, tokens, probs, row in zip(offsets.tolist(), spec.token_ids, spec.draft_probs,
                                                          spec.rows.tolist())]
        verify_logits = logits[num_plain:]
        tokens, used_rows = verify(verify_logits, verifying, proposals)
        for row, request_tokens in zip(spec.rows.tolist(), tokens):
            req_ids.extend([batch.req_ids[row]] * len(request_tokens))
        token_ids = torch.cat([plain_ids, torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64,
                                                       device=self.device)])
        tops = [top for top in (sampling.num_top_logprobs if num_plain else None, verifying.num_top_logprobs)
                if top is not None]
        return summarise(torch.cat([logits[:num_plain], verify_logits[used_rows]]), token_ids,
                         max(tops) if tops else None)

    def _prepare(self, scheduler_output: SchedulerOutput, spec: SpecRows | None):
        """Ids, positions, slot mapping and block tables for the step's rows by array ops on the batch; the
        batch rows that sample, in the order of the logits rows; after them, every speculating request's
        1 + k rows."""
        batch = self.input_batch
        rows, num_new = batch.step_rows(scheduler_output)
        context = batch.num_computed_tokens[rows]
        max_blocks = int(batch.num_blocks[rows].max())
        layout = build_layout(batch.block_table[rows, :max_blocks], context, num_new, self.block_size,
                              self.device, self.use_kernel)
        input_ids = batch.token_ids[rows[layout.token_row], layout.positions].astype(np.int64)
        sampling_rows, logits_indices = batch.sampling_rows(rows, num_new, scheduler_output)
        if spec is not None:
            index_of = {row: index for index, row in enumerate(rows.tolist())}
            ends = layout.row_ends[[index_of[row] for row in spec.rows.tolist()]]
            lengths = num_new[[index_of[row] for row in spec.rows.tolist()]]
            logits_indices = np.concatenate([logits_indices, *(np.arange(end - length, end)
                                                               for end, length in zip(ends, lengths))])
        return (to_device(input_ids, self.device), to_device(layout.positions, self.device), layout.meta,
                to_device(logits_indices, self.device), sampling_rows)
