"""The pooling runner (vLLM's "pooling" runner kind): the same persistent batch, block tables and attention
metadata as the generating runner, but each step's prompts come whole and leave as one pooled row each."""
from __future__ import annotations

import time

import numpy as np
import torch

from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner


class PoolingModelRunner(ModelRunner):
    """model: a pooling model (forward_pooled). Nothing is sampled: the step's output is pooler_output."""

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        started = time.perf_counter()
        batch = self.input_batch
        batch.update(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput([], [], [], prepare_seconds=time.perf_counter() - started)
        rows, num_new = batch.step_rows(scheduler_output)
        if (batch.num_computed_tokens[rows] != 0).any() or (num_new != batch.num_tokens[rows]).any():
            raise RuntimeError("the pooling runner computes every prompt whole in one step; the scheduler split one")
        max_blocks = int(batch.num_blocks[rows].max())
        meta, positions, token_row = self.attention_metadata(batch.block_table[rows, :max_blocks],
                                                             batch.num_computed_tokens[rows], num_new)
        input_ids = self.staging.to_device("input_ids", batch.token_ids[rows[token_row], positions].astype(np.int64))
        starts = np.cumsum(num_new) - num_new
        prepare_seconds = time.perf_counter() - started
        pooled = self.model.forward_pooled(input_ids, self.staging.to_device("positions", positions), self.kv_caches,
                                           meta, starts, num_new).cpu().numpy()
        return ModelRunnerOutput([], [], [], prepare_seconds=prepare_seconds,
                                 pooler_output={batch.req_ids[row]: pooled[index]
                                                for index, row in enumerate(rows.tolist())})

    def _profile_forward(self, num_tokens, num_seqs, positions, kv_caches, meta) -> None:
        """One prompt of num_tokens, pooled (num_seqs rows pool no more than one: pooled rows are tiny)."""
        self.model.forward_pooled(torch.zeros(num_tokens, dtype=torch.int64, device=self.device), positions,
                                  kv_caches, meta, np.zeros(1, np.int64), np.array([num_tokens]))
