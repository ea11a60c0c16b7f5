"""Draft-model proposals, in the worker: a smaller model with the same tokenizer proposes k tokens, one
forward pass each, for the target to verify in one.

The draft keeps its own paged KV cache, indexed by the same block ids as the target's: the scheduler's
block tables and slots cover both, so the draft needs no block bookkeeping of its own, and copy-on-write
copies the same blocks in both pools. Its KV is caught up lazily: when a request first proposes (after
its prefill, a preemption or a fork) the draft computes every token it lacks in one chunk, which is its
prefill; afterwards each proposal pass writes the KV of the proposal it feeds, which stays valid as far as
the target accepted it. Draft KV only shapes proposals, never the output (verification is exact), so a
slot the draft rewrote in a shared block costs nothing but, at worst, a lower acceptance rate.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.model.attention.metadata import decode_rows_first
from pagedllm.model.llama import CausalLM
from pagedllm.step import SchedulerOutput
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.model_runner import allocate_kv_caches
from pagedllm.worker.sampler import (SamplingBatch, argmax_rows, changes_logits, draw, penalised_logits,
                                     probabilities)


class DraftModelProposer:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.device = device
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, kv_cache_dtype, device,
                                            model.num_kv_heads)
        self.num_computed: dict[str, int] = {}   # request id -> leading tokens whose draft KV is in place

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Forgets requests that left the batch; one that (re)joins it computes its draft KV from the start."""
        for request_id in (*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids):
            self.num_computed.pop(request_id, None)
        for request in scheduler_output.scheduled_new_reqs:
            self.num_computed.pop(request.request_id, None)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, num_spec: np.ndarray, attention_metadata
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Proposals for batch rows `rows` (num_spec[i] each), written into the batch's token ids after each
        row's last token, and the distribution each was drawn from ([k, vocab]; None on greedy rows).
        attention_metadata: the target runner's (ModelRunner.attention_metadata), for the same block tables."""
        request_ids = [batch.req_ids[row] for row in rows.tolist()]
        num_tokens = batch.num_tokens[rows]
        # Draft KV is valid up to what the target kept: proposals past the first rejection were wrong.
        start = np.minimum([self.num_computed.get(request_id, 0) for request_id in request_ids],
                           batch.num_computed_tokens[rows])
        proposals = np.zeros((len(rows), int(num_spec.max())), np.int64)
        draft_probs: list[list[torch.Tensor]] = [[] for _ in request_ids]
        for position in range(proposals.shape[1]):
            active = np.flatnonzero(num_spec > position)
            if position == 0:   # catch up on every token without draft KV, the last one included
                logits = self._forward(batch, rows, start, num_tokens - start, attention_metadata)
            else:               # feed the previous proposal
                logits = self._forward(batch, rows[active], num_tokens[active] + position - 1,
                                       np.ones(len(active), np.int64), attention_metadata)
            chosen, probs = self._choose(batch, rows[active], num_tokens[active] + position, logits)
            proposals[active, position] = chosen
            batch.token_ids[rows[active], num_tokens[active] + position] = chosen
            if probs is not None:
                for index, row_probs in zip(active.tolist(), probs):
                    if row_probs is not None:
                        draft_probs[index].append(row_probs)
        for request_id, total, count in zip(request_ids, num_tokens.tolist(), num_spec.tolist()):
            self.num_computed[request_id] = total + count - 1
        return ([proposals[index, :count].tolist() for index, count in enumerate(num_spec.tolist())],
                [torch.stack(probs) if probs else None for probs in draft_probs])

    def _forward(self, batch: InputBatch, rows: np.ndarray, context: np.ndarray, num_new: np.ndarray,
                 attention_metadata) -> torch.Tensor:
        """The draft's logits at each row's last new token, rows in the order given."""
        order = decode_rows_first(num_new)   # as the attention metadata takes them
        rows, context, num_new = rows[order], context[order], num_new[order]
        max_blocks = int(batch.num_blocks[rows].max())
        meta, positions, token_row = attention_metadata(batch.block_table[rows, :max_blocks], context, num_new)
        input_ids = batch.token_ids[rows[token_row], positions].astype(np.int64)
        logits = self.model(self._to_device(input_ids), self._to_device(positions), self.kv_caches, meta,
                            self._to_device(np.cumsum(num_new) - 1))
        return logits[torch.from_numpy(np.argsort(order, kind="stable")).to(self.device)]

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def _choose(self, batch: InputBatch, rows: np.ndarray, num_tokens: np.ndarray, raw_logits: torch.Tensor
                ) -> tuple[np.ndarray, list[torch.Tensor | None] | None]:
        """Each row's proposal from the draft's logits, processed as the target's will be (penalties over
        the tokens so far, proposals included; temperature, top-k/p...): the argmax on greedy rows, a
        draw elsewhere, with the distribution it came from."""
        sampling = SamplingBatch.build(batch.sampling, rows, batch.token_ids, batch.num_prompt_tokens[rows],
                                       num_tokens, raw_logits.shape[-1], self.device)
        logits = penalised_logits(raw_logits, sampling) if changes_logits(sampling) else raw_logits
        greedy_ids = argmax_rows(logits)
        if sampling.all_greedy:
            return greedy_ids.cpu().numpy(), None
        probs = probabilities(logits.clone(), sampling)
        sampled = draw(probs, sampling.seeded_rows)
        greedy = batch.sampling.greedy[rows]
        chosen = torch.where(torch.from_numpy(greedy).to(self.device), greedy_ids, sampled)
        return chosen.cpu().numpy(), [None if is_greedy else row for is_greedy, row in zip(greedy.tolist(), probs)]
