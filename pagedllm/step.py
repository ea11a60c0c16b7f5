"""The plain data that crosses the seam between the scheduler and the workers, once per step.

Only what changed travels (vLLM v1's shape): a request the workers do not hold comes whole, a
running one as the tokens and block ids it gained since its last step. Nothing here holds a tensor
or an engine object, so the same step goes to the in-process runner or is broadcast to
tensor-parallel ranks, and a scheduler test can read it without a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.kv.disk_loads import DiskWork
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request joining the workers' batch: first scheduled, resumed after preemption, or forked."""
    request_id: str
    token_ids: list[int]             # prompt, then the output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int
    # A parallel sample forked in this step: it computes nothing and takes its first token from
    # this request's logits row, so n samples share one prefill.
    sample_with: str | None = None
    lora_request: LoRARequest | None = None   # the adapter its rows run with; None: the base model


@dataclass(slots=True)
class CachedRequestData:
    """Requests already in the workers' batch: what changed since they last ran.

    A plain decode (one token sampled since, its KV computed up to the tokens the workers hold, its block
    table unchanged) travels as its id and that token only, index for index in the decode lists; the
    workers derive the rest. Every other change (a new block, a copied entry, several tokens, a chunk) goes
    in the general lists, index for index."""
    decode_request_ids: list[str] = field(default_factory=list)
    decode_token_ids: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)    # appended since: sampled, or a beam's choice
    block_table_starts: list[int] = field(default_factory=list)     # first table entry that changed
    new_block_ids: list[list[int]] = field(default_factory=list)    # the table from that entry on
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)   # every request in the step
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)   # leave the batch; their random state stays
    finished_req_ids: list[str] = field(default_factory=list)    # done since the last step: forget them
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # (source, destination), copy on write
    # Structured outputs: row i of the int32 bitmask ([rows, ceil(vocab / 32)]) holds the tokens that
    # grammar_request_ids[i] may sample in this step; None when no sampling row has a grammar.
    grammar_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: request id -> proposal rows it verifies in this step (counted in
    # num_scheduled_tokens, after its one decode row), and the proposals the scheduler made (ngram). A
    # request in num_spec_tokens but not in spec_token_ids takes its proposals from the worker's draft model.
    num_spec_tokens: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    disk_work: DiskWork | None = None   # the KV tiers' block moves (disk tier, swap); None without either

    @property
    def has_work(self) -> bool:
        """Whether the workers have anything to do in this step."""
        return bool(self.num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids or (
            self.disk_work is not None and self.disk_work.has_work))


@dataclass(slots=True)
class PromptLogprobs:
    """One request's prompt logprobs from one step: the prompt tokens first_position on, one entry each."""
    first_position: int                # >= 1: the first prompt token has nothing before it to score it
    token_logprobs: list[float]
    token_ranks: list[int]             # 1 = most likely
    top_ids: list[list[int]]           # the request's top-k, by falling logprob
    top_logprobs: list[list[float]]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step sampled, one row per token; the top-k fields are None when no row asked for logprobs.

    A speculating request has 1 + (accepted proposals) consecutive rows, in sequence order: the accepted
    proposals, then the target's own token (the correction at the first rejection, or the bonus token)."""
    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[float]                       # of the sampled token, under the raw distribution
    top_logprob_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    token_ranks: list[int] | None = None        # the sampled token's rank, 1 = most likely
    prepare_seconds: float = 0.0                # the runner's share of step preparation (batch update, inputs)
    prompt_logprobs: dict[str, PromptLogprobs] | None = None   # by request id, for those that asked
    # Pooling runner: each request computed in the step (always whole) and its pooled float32 row.
    pooler_output: dict[str, np.ndarray] | None = None
    kv_load_failures: list[int] = field(default_factory=list)   # block ids a disk load or swap-in could not fill
    kv_swap_seconds: float = 0.0   # the step's swap copies, out and in (what preemption_mode auto weighs)
