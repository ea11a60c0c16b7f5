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

from pagedllm.lora.worker_manager import LoRAWorkerManager
from pagedllm.model.attention.cache import CacheTensor, has_scales, kv_cache_shapes, kv_scales_shape
from pagedllm.model.attention.metadata import MAX_DECODE_ROW_TOKENS, AttentionMetadata
from pagedllm.model.attention.selector import select_attention_backend
from pagedllm.model.cascade import CascadeRule, find_shared_prefixes
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import CausalLM
from pagedllm.model.tensor_parallel import num_kv_heads_per_rank
from pagedllm.worker.rejection_sampler import Proposal, verify
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.host_staging import HostStaging, fetch
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.kv_disk_store import DiskKVStore, copy_blocks_in, copy_blocks_out
from pagedllm.worker.kv_swap import DiskSwapSpace, RamSwapSpace
from pagedllm.worker.prompt_logprobs import PromptLogprobsPlan, compute_prompt_logprobs
from pagedllm.worker.sampler import SamplerOutput, SamplingBatch, choose_tokens, sample, summarise
from pagedllm.worker.token_bitmask import apply_token_bitmask


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


def copy_blocks(kv_caches: list[tuple[CacheTensor, CacheTensor]], sources: torch.Tensor,
                destinations: torch.Tensor) -> None:
    """Copies whole blocks (sources[i] to destinations[i]) in every layer's caches: copy on write."""
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
    def __init__(self, model: CausalLM, num_blocks: int | None, block_size: int, kv_cache_dtype: torch.dtype,
                 device: torch.device, seed: int, max_model_len: int, max_num_seqs: int,
                 attention_backend: str = "auto", dtype: torch.dtype = torch.float32,
                 drafter=None, lora: LoRAWorkerManager | None = None):
        """num_blocks None: the caches are allocated later (allocate_kv_caches), once a profile run has
        measured what the model leaves free. attention_backend: an EngineConfig value, resolved here once.
        drafter: a DraftModelProposer (pagedllm/worker/draft_model.py) for draft-model speculation.
        lora: the adapters of a LoRA-enabled engine (pagedllm/lora/worker_manager.py)."""
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.vocab_size = config.vocab_size
        self.kv_cache_dtype = kv_cache_dtype
        self.attention_backend = select_attention_backend(attention_backend, device, config.head_dim, block_size,
                                                          dtype, kv_cache_dtype, model.attention_layers)
        self.kv_caches: list[tuple[CacheTensor, CacheTensor]] = []
        if num_blocks is not None:
            self.allocate_kv_caches(num_blocks)
        self.input_batch = InputBatch(max_model_len, block_size, device, capacity=max_num_seqs)
        self.staging = HostStaging(device)
        self.dtype = dtype
        # Which shared-prefix groups go to the cascade kernel (set at start-up: worker/cascade_choice.py);
        # None: none do. cascade_parts counts the step parts (decodes, prefill chunks) it served.
        self.cascade_rule: CascadeRule | None = None
        self.cascade_parts = {"decode": 0, "prefill": 0}
        self.drafter = drafter
        self.lora = lora
        self.kv_disk_store: DiskKVStore | None = None   # set by Worker.open_kv_disk_tier
        self.kv_swap_space: RamSwapSpace | DiskSwapSpace | None = None   # set by Worker.open_kv_swap_space
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
        self._profile_forward(num_tokens, num_seqs, self.staging.to_device("positions", positions), scratch, meta)
        if not on_cuda:
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - scratch_bytes

    def _profile_forward(self, num_tokens: int, num_seqs: int, positions: torch.Tensor,
                         kv_caches: list[tuple[CacheTensor, CacheTensor]], meta: AttentionMetadata) -> None:
        """The profile run's forward pass: one prompt of num_tokens, then logits and sampling for num_seqs rows."""
        logits_indices = torch.full((num_seqs,), num_tokens - 1, device=self.device)
        logits = self.model(torch.zeros(num_tokens, dtype=torch.int64, device=self.device), positions, kv_caches,
                            meta, logits_indices)
        if logits is not None:   # the sampler's own buffers: a softmax and a sort over the vocabulary per row
            logits.softmax(-1).sort(dim=-1)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Moves the step's blocks between the tiers first (blocks spilled or swapped out in this step may be
        written by it)."""
        failures, swap_seconds = [], 0.0
        if scheduler_output.disk_work is not None:
            failures, swap_seconds = self._move_tier_blocks(scheduler_output)
        output = self._execute(scheduler_output)
        output.kv_load_failures = failures
        output.kv_swap_seconds = swap_seconds
        return output

    def _move_tier_blocks(self, scheduler_output: SchedulerOutput) -> tuple[list[int], float]:
        """Copies spilled and swapped-out blocks out, reads loads and swap-ins in, then queues the writes and
        deletes and drops the swapped blocks no one reads; returns the block ids that could not be read and
        the seconds the swap copies took."""
        work, store, swap, kv_caches = scheduler_output.disk_work, self.kv_disk_store, self.kv_swap_space, self.kv_caches
        spilled = copy_blocks_out(kv_caches, [block_id for block_id, _, _ in work.spills]) if work.spills else ()
        started = time.perf_counter()
        if work.swap_outs:
            for (_, key), payload in zip(work.swap_outs, copy_blocks_out(kv_caches, [b for b, _ in work.swap_outs])):
                swap.save(key, payload)
        swap_seconds = time.perf_counter() - started
        failures = self._read_back(work.loads, lambda load: store.read(load[1], load[2]))
        started = time.perf_counter()
        failures += self._read_back(work.swap_ins, lambda swap_in: swap.take(swap_in[1]))
        swap_seconds += time.perf_counter() - started
        for (block_id, block_hash, digest), payload in zip(work.spills, spilled):
            store.write(block_hash, digest, payload)
        for block_hash in work.deletes:
            store.delete(block_hash)
        for key in work.swap_drops:
            swap.drop(key)
        for block_hash, digest in work.read_ahead:   # read while this step's forward pass runs
            store.read_ahead(block_hash, digest)
        return failures, swap_seconds

    def _read_back(self, items: list[tuple], read) -> list[int]:
        """Reads each (block id, ...) item's payload and copies all those read into their blocks at once;
        returns the block ids that could not be read."""
        landed, payloads, failures = [], [], []
        for item in items:
            payload = read(item)
            (failures if payload is None else landed).append(item[0])
            if payload is not None:
                payloads.append(payload)
        if landed:
            copy_blocks_in(self.kv_caches, landed, torch.stack(payloads))
        return failures

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Updates the batch, makes the copy-on-write block copies, runs one forward pass, and samples."""
        started = time.perf_counter()
        batch = self.input_batch
        batch.update(scheduler_output)
        if self.lora is not None:
            for request in scheduler_output.scheduled_new_reqs:
                self.lora.note(request.lora_request)
        if self.drafter is not None:
            self.drafter.update(scheduler_output)
        if scheduler_output.block_copies:
            self._copy_blocks(scheduler_output.block_copies)
        if not scheduler_output.num_scheduled_tokens:   # a step that only drops finished or preempted requests
            return ModelRunnerOutput([], [], [], prepare_seconds=time.perf_counter() - started)
        drafting_started = time.perf_counter()
        spec = self._propose(scheduler_output) if scheduler_output.num_spec_tokens else None
        drafting_seconds = time.perf_counter() - drafting_started   # the draft model's passes: model time
        input_ids, positions, meta, logits_indices, sampling_rows, prompt_plan, rope_lengths = self._prepare(
            scheduler_output, spec)
        prepared = time.perf_counter()
        prepare_seconds = prepared - started - drafting_seconds
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices, rope_lengths)
        if logits is None:   # tensor-parallel ranks > 0 get no logits: rank 0 samples
            return ModelRunnerOutput([], [], [], prepare_seconds=prepare_seconds)
        prompt_logprobs = None
        if prompt_plan is not None:   # their rows come last
            num_token_rows = len(logits) - len(prompt_plan.token_indices)
            prompt_logprobs = compute_prompt_logprobs(logits[num_token_rows:], prompt_plan)
            logits = logits[:num_token_rows]
        if not len(logits):
            return ModelRunnerOutput([], [], [], prepare_seconds=prepare_seconds, prompt_logprobs=prompt_logprobs)
        req_ids = list(map(batch.req_ids.__getitem__, sampling_rows.tolist()))
        if scheduler_output.grammar_bitmask is not None:   # requests under a grammar never speculate
            logits = self._apply_grammar_bitmask(logits, req_ids, scheduler_output)
        sampling = SamplingBatch.build(batch.sampling, sampling_rows, batch.token_ids,
                                       batch.num_prompt_tokens[sampling_rows], batch.num_tokens[sampling_rows],
                                       self.vocab_size, self.device)
        samples = sample(logits, sampling) if spec is None else self._verify(logits, sampling, spec, req_ids)
        token_ids, logprobs, top_ids, top_logprobs, ranks = fetch(
            [samples.token_ids, samples.logprobs, samples.top_logprob_ids, samples.top_logprobs, samples.token_ranks])
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=token_ids,
            logprobs=logprobs,
            top_logprob_ids=top_ids,
            top_logprobs=top_logprobs,
            token_ranks=ranks,
            prepare_seconds=prepare_seconds,
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str], scheduler_output: SchedulerOutput
                               ) -> torch.Tensor:
        """Structured outputs: the rows with a grammar may sample only what it allows next (float32 logits:
        the sampler's dtype)."""
        logits_row = {request_id: index for index, request_id in enumerate(req_ids)}
        rows = torch.tensor([logits_row[request_id] for request_id in scheduler_output.grammar_request_ids])
        logits = logits.float()
        apply_token_bitmask(logits, scheduler_output.grammar_bitmask, rows)
        return logits

    def _copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy on write, in the draft model's KV pool too (it is indexed by the same block ids)."""
        sources, destinations = (self.staging.to_device(name, np.array(ids))
                                 for name, ids in zip(("copy_sources", "copy_destinations"), zip(*block_copies)))
        copy_blocks(self.kv_caches, sources, destinations)
        if self.drafter is not None:
            copy_blocks(self.drafter.kv_caches, sources, destinations)

    def _propose(self, scheduler_output: SchedulerOutput) -> SpecRows:
        """The speculating requests' proposals (the scheduler's, or the draft model's, made here first),
        written after each one's last token in the batch, where the step's input ids are read from."""
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
            drafted, probs = self.drafter.propose(batch, rows[to_draft], counts, self.attention_metadata)
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
        plain_ids, plain_normaliser = (choose_tokens(logits[:num_plain], sampling) if num_plain else
                                       (torch.empty(0, dtype=torch.int64, device=self.device),
                                        torch.empty(0, 1, dtype=logits.dtype, device=self.device)))
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
        tokens, used_rows, verify_normaliser = verify(logits[num_plain:], verifying, proposals)
        for row, request_tokens in zip(spec.rows.tolist(), tokens):
            req_ids.extend([batch.req_ids[row]] * len(request_tokens))
        token_ids = torch.cat([plain_ids, torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64,
                                                       device=self.device)])
        tops = [top for top in (sampling.num_top_logprobs if num_plain else None, verifying.num_top_logprobs)
                if top is not None]
        # Each token's logits row, read in place: copying the used rows out cost as much as the verification.
        rows = torch.cat([torch.arange(num_plain), torch.tensor(used_rows, dtype=torch.int64) + num_plain]).to(
            self.device)
        return summarise(logits, token_ids, max(tops) if tops else None,
                         torch.cat([plain_normaliser, verify_normaliser]), rows)

    def _shared_prefixes(self, decode_tables: np.ndarray, decode_context: np.ndarray, prefill_tables: np.ndarray,
                         prefill_context: np.ndarray) -> dict:
        """The cascade groups among the step's decodes and among its prefill chunks that the rule keeps (none
        when switched off)."""
        rule = self.cascade_rule
        if rule is None:
            return {}
        parts = {"decode": find_shared_prefixes(decode_tables, decode_context, self.block_size, rule),
                 "prefill": find_shared_prefixes(prefill_tables, prefill_context, self.block_size, rule)}
        for part, groups in parts.items():
            self.cascade_parts[part] += groups is not None
        return {f"{part}_cascade": groups for part, groups in parts.items()}

    def _prepare(self, scheduler_output: SchedulerOutput, spec: SpecRows | None):
        """Ids, positions, slot mapping and block tables for the step's rows by array ops on the batch; the
        batch rows that sample, in the order of the logits rows; after them every speculating request's
        1 + k rows; and last the rows prompt logprobs add. For rope kinds that choose frequencies by the
        sequence's length: each token's prompt length (None otherwise)."""
        batch, staging = self.input_batch, self.staging
        rows, num_new = batch.step_rows(scheduler_output)
        max_blocks = int(batch.num_blocks[rows].max())
        meta, positions, token_row = self.attention_metadata(batch.block_table[rows, :max_blocks],
                                                             batch.num_computed_tokens[rows], num_new)
        input_ids = batch.token_ids[rows[token_row], positions].astype(np.int64)
        if self.lora is not None:
            self.lora.prepare_step(batch.lora_ids[rows[token_row]])
        sampling_rows, logits_indices = batch.sampling_rows(rows, num_new, scheduler_output)
        if spec is not None:
            index_of = {row: index for index, row in enumerate(rows.tolist())}
            spec_index = [index_of[row] for row in spec.rows.tolist()]
            ends, lengths = np.cumsum(num_new)[spec_index], num_new[spec_index]
            logits_indices = np.concatenate([logits_indices, *(np.arange(end - length, end)
                                                               for end, length in zip(ends, lengths))])
        prompt_plan = PromptLogprobsPlan.for_step(batch.sampling.num_prompt_logprobs, batch.req_ids, rows, num_new,
                                                  batch.num_computed_tokens, batch.num_prompt_tokens, batch.token_ids)
        if prompt_plan is not None:
            logits_indices = np.concatenate([logits_indices, prompt_plan.token_indices])
        rope_lengths = None
        if self.model.rope.needs_lengths:
            rope_lengths = staging.to_device("rope_lengths", batch.num_prompt_tokens[rows][token_row].astype(np.int64))
        return (staging.to_device("input_ids", input_ids), staging.to_device("positions", positions), meta,
                staging.to_device("logits_indices", logits_indices), sampling_rows, prompt_plan, rope_lengths)

    def attention_metadata(self, block_tables: np.ndarray, context: np.ndarray, num_new: np.ndarray
                           ) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
        """The attention layout of rows with `context` tokens cached and `num_new` new ones, their blocks in
        block_tables (the rows of at most MAX_DECODE_ROW_TOKENS first: their tokens attend as decodes); and each
        new token's position and row."""
        block_size, staging = self.block_size, self.staging
        row_ends = np.cumsum(num_new)
        row_starts = row_ends - num_new
        num_tokens = int(row_ends[-1])
        seq_lens = context + num_new
        decodes_only = num_tokens == len(num_new)   # one token a row: the usual decode step
        if decodes_only:   # token i is row i's, at the row's first uncached position, and every row a decode
            token_row, positions = row_starts, context
            num_decode_rows = num_decodes = num_tokens
            decode_rows, decode_lens = slice(None), seq_lens
        else:
            token_row = np.repeat(np.arange(len(num_new)), num_new)
            positions = np.arange(num_tokens) - row_starts[token_row] + context[token_row]
            longer = num_new > MAX_DECODE_ROW_TOKENS   # the leading rows up to the first longer one attend as decodes
            num_decode_rows = int(np.argmax(longer)) if longer.any() else len(num_new)
            num_decodes = int(row_ends[num_decode_rows - 1]) if num_decode_rows else 0
            decode_rows, decode_lens = token_row[:num_decodes], positions[:num_decodes] + 1
        slot_mapping = block_tables[token_row, positions // block_size] * block_size + positions % block_size
        decode_tables = block_tables[decode_rows, :-(-int(decode_lens.max()) // block_size) if num_decodes else 0]
        tables = staging.to_device("block_tables", block_tables)
        seq_lens_tensor = staging.to_device("seq_lens", seq_lens)
        query_starts = staging.to_device("query_starts", np.append(row_starts, num_tokens))
        meta = AttentionMetadata(
            slot_mapping=staging.to_device("slot_mapping", slot_mapping),
            num_decode_tokens=num_decodes,
            # A decode-only step's decode fields are the whole step's (its tables where as wide): no second tensor.
            decode_block_tables=(tables if decodes_only and decode_tables.shape == block_tables.shape
                                 else staging.to_device("decode_block_tables", decode_tables)),
            decode_seq_lens=seq_lens_tensor if decodes_only else staging.to_device("decode_seq_lens", decode_lens),
            prefill_query_starts=query_starts[num_decode_rows:],
            prefill_context_lens=staging.to_device("context_lens", context[num_decode_rows:]),
            prefill_block_tables=tables[num_decode_rows:],
            block_size=block_size,
            query_starts=query_starts,
            seq_lens=seq_lens_tensor,
            block_tables=tables,
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            backend=self.attention_backend,
            **self._shared_prefixes(decode_tables, decode_lens - 1, block_tables[num_decode_rows:],
                                    context[num_decode_rows:]),
        )
        return meta, positions, token_row
