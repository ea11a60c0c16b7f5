"""The worker's running requests as rows of numpy arrays: token ids, block tables and sampling columns.

Rows change by add, update and remove as requests come and go, never rebuilt from request objects
(vLLM's gpu_input_batch idea). A removed row is filled at once by the last row, so rows stay dense
and a step's arrays are slices and gathers. Capacity doubles when a row is added to a full batch.
"""
from __future__ import annotations

import enum
import itertools
import math

import numpy as np
import torch

from pagedllm.model.attention.metadata import decode_rows_first
from pagedllm.sampling_params import SamplingParams
from pagedllm.step import NewRequestData, SchedulerOutput
from pagedllm.worker.logit_controls import RowLogitControls

_FLOAT32 = np.finfo(np.float32)
_TINY, _HUGE = float(_FLOAT32.tiny), float(_FLOAT32.max)


class RowFeature(enum.IntFlag):
    """The sampling features a row uses besides its temperature: a step ORs its rows' flags once and gathers the
    columns of the features some row uses only (gathering and testing every column took a batch-1 step's
    SamplingBatch.build 0.23-0.26 ms, the flags 0.17-0.19, alternated on AVX2)."""
    TOP_K = enum.auto()
    TOP_P = enum.auto()
    MIN_P = enum.auto()
    REPETITION = enum.auto()
    FREQUENCY_PRESENCE = enum.auto()
    MIN_TOKENS = enum.auto()
    LOGPROBS = enum.auto()
    SEEDED = enum.auto()
    LOGIT_CONTROLS = enum.auto()

    @classmethod
    def of(cls, params: SamplingParams, seeded: bool, has_logit_controls: bool) -> RowFeature:
        flags = cls(0)
        for used, flag in ((params.top_k > 0, cls.TOP_K), (params.top_p < 1.0, cls.TOP_P), (params.min_p > 0.0, cls.MIN_P),
                           (params.repetition_penalty != 1.0, cls.REPETITION),
                           (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0, cls.FREQUENCY_PRESENCE),
                           (params.min_tokens > 0, cls.MIN_TOKENS), (params.logprobs is not None, cls.LOGPROBS),
                           (seeded, cls.SEEDED), (has_logit_controls, cls.LOGIT_CONTROLS)):
            if used:
                flags |= flag
        return flags


class SamplingColumns:
    """Each row's sampling parameters as one value per array, in the form the sampler's tensors take."""

    def __init__(self, capacity: int):
        self.temperature = np.ones(capacity, np.float32)          # 1.0 on greedy rows
        self.greedy = np.zeros(capacity, bool)
        self.top_k = np.zeros(capacity, np.int64)                  # 0: off
        self.top_p = np.full(capacity, math.inf, np.float32)       # inf: off (see sampler._apply_top_k_top_p)
        self.log_min_p = np.full(capacity, -math.inf, np.float32)  # -inf: off
        self.repetition_penalty = np.ones(capacity, np.float32)
        self.frequency_penalty = np.zeros(capacity, np.float32)
        self.presence_penalty = np.zeros(capacity, np.float32)
        self.min_tokens = np.zeros(capacity, np.int64)
        self.num_logprobs = np.full(capacity, -1, np.int64)        # -1: no logprobs asked
        self.seeded = np.zeros(capacity, bool)                     # owns a generator
        self.num_prompt_logprobs = np.full(capacity, -1, np.int64)  # -1: no prompt logprobs asked
        self.features = np.zeros(capacity, np.int64)               # RowFeature flags
        # Token ids min_tokens holds back (EOS and stop_token_ids), and the seeded generators: Python per row.
        self.stop_ids: list[tuple[int, ...]] = [()] * capacity
        self.generators: list[torch.Generator | None] = [None] * capacity
        self.logit_controls: list[RowLogitControls | None] = [None] * capacity

    ARRAYS = ("temperature", "greedy", "top_k", "top_p", "log_min_p", "repetition_penalty", "frequency_penalty",
              "presence_penalty", "min_tokens", "num_logprobs", "seeded", "num_prompt_logprobs",
              "features")
    LISTS = ("stop_ids", "generators", "logit_controls")

    def set_row(self, row: int, params: SamplingParams, eos_token_ids: tuple[int, ...],
                generator: torch.Generator | None) -> None:
        greedy = params.is_greedy
        # Divisors are kept inside float32's range: a temperature of 1e300 or a penalty of 1e-300 would
        # round to inf or 0 and turn -inf logits into NaN.
        self.temperature[row] = 1.0 if greedy else min(max(params.temperature, _TINY), _HUGE)
        self.greedy[row] = greedy
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p if params.top_p < 1.0 else math.inf
        self.log_min_p[row] = math.log(params.min_p) if params.min_p > 0.0 else -math.inf
        self.repetition_penalty[row] = min(max(params.repetition_penalty, _TINY), _HUGE)
        self.frequency_penalty[row] = params.frequency_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.stop_ids[row] = (*eos_token_ids, *params.stop_token_ids) if params.min_tokens else ()
        self.generators[row] = generator
        self.seeded[row] = generator is not None
        self.logit_controls[row] = RowLogitControls.of(params)
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.features[row] = RowFeature.of(params, generator is not None, self.logit_controls[row] is not None)

    def move_row(self, source: int, destination: int) -> None:
        for name in self.ARRAYS:
            array = getattr(self, name)
            array[destination] = array[source]
        for name in self.LISTS:
            values = getattr(self, name)
            values[destination] = values[source]
        self.generators[source] = None

    def grown(self, capacity: int) -> SamplingColumns:
        bigger = SamplingColumns(capacity)
        size = len(self.temperature)
        for name in self.ARRAYS:
            getattr(bigger, name)[:size] = getattr(self, name)
        for name in self.LISTS:
            getattr(bigger, name)[:size] = getattr(self, name)
        return bigger


class InputBatch:
    def __init__(self, max_model_len: int, block_size: int, device: torch.device, capacity: int = 16):
        self.max_model_len = max_model_len
        self.max_blocks_per_request = -(-max_model_len // block_size)
        self.device = device
        self.req_ids: list[str] = []
        self.row_of: dict[str, int] = {}
        # Seeded requests' generators, kept until the request finishes (through preemptions too).
        self.generators: dict[str, torch.Generator] = {}
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.token_ids = np.zeros((capacity, self.max_model_len), np.int32)
        self.num_tokens = np.zeros(capacity, np.int64)
        self.num_prompt_tokens = np.zeros(capacity, np.int64)
        self.num_computed_tokens = np.zeros(capacity, np.int64)
        self.block_table = np.zeros((capacity, self.max_blocks_per_request), np.int64)
        self.num_blocks = np.zeros(capacity, np.int64)
        self.lora_ids = np.zeros(capacity, np.int64)   # the row's adapter (LoRARequest.lora_int_id); 0: the base
        self.sampling = SamplingColumns(capacity)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def capacity(self) -> int:
        return len(self.num_tokens)

    def _grow(self) -> None:
        old = (self.token_ids, self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
               self.block_table, self.num_blocks, self.lora_ids)
        sampling = self.sampling
        self._allocate(2 * self.capacity)
        for new, previous in zip((self.token_ids, self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                                  self.block_table, self.num_blocks, self.lora_ids), old):
            new[:len(previous)] = previous
        self.sampling = sampling.grown(self.capacity)

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Applies a step's changes: finished and preempted requests leave, new ones join, running ones grow."""
        for request_id in scheduler_output.finished_req_ids:
            self.remove(request_id)
            self.generators.pop(request_id, None)
        for request_id in scheduler_output.preempted_req_ids:
            self.remove(request_id)
        for request in scheduler_output.scheduled_new_reqs:
            self.add(request)
        cached = scheduler_output.scheduled_cached_reqs
        if cached.decode_request_ids:
            self.update_decodes(cached.decode_request_ids, cached.decode_token_ids)
        if cached.request_ids:
            self.update_running(cached.request_ids, cached.new_token_ids, cached.block_table_starts,
                                cached.new_block_ids, cached.num_computed_tokens)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        generator = self.generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self.generators[request_id] = generator
        return generator

    def add(self, request: NewRequestData) -> None:
        """Adds a request's row (replacing any row left under its id by a step that failed mid-way)."""
        self.remove(request.request_id)
        if self.num_reqs == self.capacity:
            self._grow()
        row = self.num_reqs
        self.req_ids.append(request.request_id)
        self.row_of[request.request_id] = row
        num_tokens = len(request.token_ids)
        self.token_ids[row, :num_tokens] = request.token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = request.num_prompt_tokens
        self.num_computed_tokens[row] = request.num_computed_tokens
        self.block_table[row, :len(request.block_ids)] = request.block_ids
        self.num_blocks[row] = len(request.block_ids)
        self.lora_ids[row] = 0 if request.lora_request is None else request.lora_request.lora_int_id
        self.sampling.set_row(row, request.sampling_params, request.eos_token_ids,
                              self._generator(request.request_id, request.sampling_params))

    def remove(self, request_id: str) -> None:
        """Drops a request's row, moving the last row into it so the rows stay dense."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        last_id = self.req_ids.pop()
        if row != last:
            self.req_ids[row] = last_id
            self.row_of[last_id] = row
            for array in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.num_blocks,
                          self.lora_ids):
                array[row] = array[last]
            self.token_ids[row, :self.num_tokens[row]] = self.token_ids[last, :self.num_tokens[row]]
            self.block_table[row, :self.num_blocks[row]] = self.block_table[last, :self.num_blocks[row]]
            self.sampling.move_row(last, row)
        else:
            self.sampling.generators[row] = None

    def update_decodes(self, request_ids: list[str], token_ids: list[int]) -> None:
        """Plain decodes: each row's KV now reaches the tokens it held, and it gains one token; its block
        table is unchanged. A few array operations for the whole batch."""
        rows = np.fromiter(map(self.row_of.__getitem__, request_ids), np.int64, len(request_ids))
        num_tokens = self.num_tokens[rows]
        self.num_computed_tokens[rows] = num_tokens
        self.token_ids[rows, num_tokens] = token_ids
        self.num_tokens[rows] = num_tokens + 1

    def update_running(self, request_ids: list[str], new_token_ids: list[list[int]], block_table_starts: list[int],
                       new_block_ids: list[list[int]], num_computed_tokens: list[int]) -> np.ndarray:
        """Applies what running requests gained since their last step; returns their rows. The common case,
        one new token and no new block each, takes a few array operations for the whole batch."""
        count = len(request_ids)
        rows = np.fromiter(map(self.row_of.__getitem__, request_ids), np.int64, count)
        self.num_computed_tokens[rows] = num_computed_tokens
        num_new_tokens = np.fromiter(map(len, new_token_ids), np.int64, count)
        if (num_new_tokens == 1).all():
            self.token_ids[rows, self.num_tokens[rows]] = list(itertools.chain.from_iterable(new_token_ids))
            self.num_tokens[rows] += 1
        else:
            for row, tokens in zip(rows.tolist(), new_token_ids):
                start = self.num_tokens[row]
                self.token_ids[row, start:start + len(tokens)] = tokens
                self.num_tokens[row] = start + len(tokens)
        # Tables only grow, or have an entry replaced by a copy: an unchanged table sends no ids.
        for index in np.flatnonzero(np.fromiter(map(len, new_block_ids), np.int64, count)).tolist():
            row, start, block_ids = rows[index], block_table_starts[index], new_block_ids[index]
            self.block_table[row, start:start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)
        return rows

    def step_rows(self, scheduler_output: SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
        """The rows that compute in this step and their new-token counts, those whose tokens attend as decodes
        first (at most MAX_DECODE_ROW_TOKENS: model/attention/metadata.py); parallel samples forked in the
        step compute nothing and are left out."""
        counts = scheduler_output.num_scheduled_tokens
        rows = np.fromiter(map(self.row_of.__getitem__, counts), np.int64, len(counts))
        num_new = np.fromiter(counts.values(), np.int64, len(counts))
        if scheduler_output.total_num_scheduled_tokens == len(counts) and num_new.all():
            return rows, num_new   # one token each: every row decodes, in the step's order
        computing = num_new > 0
        rows, num_new = rows[computing], num_new[computing]
        order = decode_rows_first(num_new)
        return rows[order], num_new[order]

    def sampling_rows(self, rows: np.ndarray, num_new: np.ndarray, scheduler_output: SchedulerOutput
                      ) -> tuple[np.ndarray, np.ndarray]:
        """The rows that sample, and for each the index, among the step's tokens, of the token whose logits
        it samples from: a row samples when the step brings its KV up to its last token; a parallel
        sample forked in the step samples from its source's row."""
        row_ends = np.cumsum(num_new)
        samples = self.num_computed_tokens[rows] + num_new == self.num_tokens[rows]
        if samples.all():   # the usual step: every row samples
            sampling_rows, token_indices = rows, row_ends - 1
        else:
            sampling_rows, token_indices = rows[samples], row_ends[samples] - 1
        forked = [(request.request_id, request.sample_with) for request in scheduler_output.scheduled_new_reqs
                  if request.sample_with is not None]
        if forked:
            index_of = dict(zip((self.req_ids[row] for row in sampling_rows.tolist()), token_indices.tolist()))
            sampling_rows = np.append(sampling_rows, [self.row_of[child] for child, _ in forked])
            token_indices = np.append(token_indices, [index_of[source] for _, source in forked])
        return sampling_rows, token_indices
