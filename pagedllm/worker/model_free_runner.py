"""A step's worker-side bookkeeping without a model, for the model-free simulations and scheduler tests.

It keeps the real persistent InputBatch, so the plain step data is applied exactly as the model runner
applies it, and asks a callback for the sampled tokens: what these runs measure and check is
bookkeeping, which does not depend on token values.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.input_batch import InputBatch

# sample(batch, rows, num_new, sampling_rows): the step's computing rows (decode rows first) and their
# new-token counts, read before the step advances anything, and the rows that sample, in output order.
SampleFn = Callable[[InputBatch, np.ndarray, np.ndarray, np.ndarray], ModelRunnerOutput]


class ModelFreeRunner:
    def __init__(self, max_model_len: int, block_size: int, sample: SampleFn, capacity: int = 16):
        self.input_batch = InputBatch(max_model_len, block_size, torch.device("cpu"), capacity)
        self.sample = sample

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.input_batch
        batch.update(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput([], [], [])
        rows, num_new = batch.step_rows(scheduler_output)
        sampling_rows, _ = batch.sampling_rows(rows, num_new, scheduler_output)
        return self.sample(batch, rows, num_new, sampling_rows)
