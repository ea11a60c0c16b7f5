"""What every layer and backend shares: one step's attention layout, a layer's attention settings, and the
interface a backend implements.

The runner orders a step's rows so that those of at most MAX_DECODE_ROW_TOKENS new tokens come first, and each
of their tokens attends as a decode of its own, its keys ending at the token: plain decodes, short chunks, and
speculative verifications of k + 1 tokens, whose rows so get the bits of the plain decodes they stand for (the
decode kernel, the compiled decode stack). The longer rows (prefill chunks) follow. Where sequences share
leading KV blocks (forks, beams, prefix-cache hits) the runner may hand a part of the step over with
SharedPrefixGroups (model/cascade.py), for the cpu backend's cascade kernel. A layer may attend within a
sliding window (a token sees its last `window` keys, itself included: Mistral, Gemma's local layers) and
soft-cap its scores (Gemma 2: cap * tanh(score / cap) before the softmax).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.cascade import SharedPrefixGroups

# A verification of 5 tokens through the prefill kernel and the Python layers took 2.8x a one-row decode step
# (Ice Lake, docs/speculative-decoding.md), 2.2x as decodes: each token reads its sequence's keys once more, cheap
# for these few, whose keys stay in cache. 8 covers up to 7 proposals; longer rows keep the prefill kernel.
MAX_DECODE_ROW_TOKENS = 8


def decode_rows_first(num_new: np.ndarray) -> np.ndarray:
    """The order of a step's rows (their new-token counts) that puts those whose tokens attend as decodes
    first, each part in the order given."""
    return np.argsort(num_new > MAX_DECODE_ROW_TOKENS, kind="stable")


@dataclass(frozen=True)
class LayerAttention:
    """What differs between the attention of a model's layers besides the caches."""
    scale: float
    sliding_window: int | None = None   # None: every key before the token
    logit_softcap: float | None = None

    def kernel_limits(self) -> tuple[int, float]:
        """The kernels' sliding_window and logit_softcap arguments (0: none)."""
        return self.sliding_window or 0, self.logit_softcap or 0.0


class AttentionBackend(ABC):
    """One way to write and attend K/V, chosen once per engine (selector.py); every layer calls it."""
    name: str
    uses_cpu_kernels = False   # the C++ kernels serve (and with them cascade attention)

    def describe(self) -> str:
        """The backend and the kernel paths it chose, for the start-up log."""
        return self.name

    @abstractmethod
    def write_kv(self, k_cache: CacheTensor, v_cache: CacheTensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Stores new K/V rows ([tokens, kv_heads, head_dim]) at their flat slots, in the cache's dtype."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: CacheTensor,
                v_cache: CacheTensor, meta: AttentionMetadata, layer: LayerAttention) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] for the new tokens; one layer's
        caches. Rows past len(meta.slot_mapping) are padding. Writes the new K/V into the cache, then attends
        each token to its sequence's cached keys up to and including its own position (within the layer's
        window). Returns [tokens, heads, head_dim], zeros in the padding rows."""


@dataclass
class AttentionMetadata:
    """One step's attention layout, built once by the runner and shared by every layer."""
    slot_mapping: torch.Tensor          # [num_tokens] flat cache slot each new K/V goes to
    num_decode_tokens: int
    decode_block_tables: torch.Tensor   # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor       # [num_decodes] int64: keys each decode token attends to
    prefill_query_starts: torch.Tensor  # [chunks + 1] int64: chunk c is token rows [starts[c], starts[c + 1])
    prefill_context_lens: torch.Tensor  # [chunks] int64: the chunk's sequence's tokens cached before it
    prefill_block_tables: torch.Tensor  # [chunks, max_blocks] int64, covering context and chunk
    block_size: int
    # Every row at once, for a backend that attends decodes and prefill chunks in one launch (Triton); the
    # decode and prefill fields above are slices of these. The maxima are host integers: a launch grid
    # sized from them needs no read from the device.
    query_starts: torch.Tensor | None = None   # [rows + 1] int64: row r is tokens [starts[r], starts[r + 1])
    seq_lens: torch.Tensor | None = None       # [rows] int64: keys the row's last token attends to
    block_tables: torch.Tensor | None = None   # [rows, max_blocks] int64
    max_query_len: int = 0
    max_seq_len: int = 0
    backend: AttentionBackend | None = None   # the engine's, chosen once (selector.py): the model calls it
    # Sequences sharing prefix blocks, among the decodes and among the prefill chunks (cpu backend only).
    decode_cascade: SharedPrefixGroups | None = None
    prefill_cascade: SharedPrefixGroups | None = None

    @cached_property
    def decode_rows(self) -> torch.Tensor:
        return torch.arange(self.num_decode_tokens, device=self.decode_seq_lens.device)

    @cached_property
    def decode_query_starts(self) -> torch.Tensor:
        """Decodes as chunks of one token each, as the cascade kernel takes sequences."""
        return torch.arange(self.num_decode_tokens + 1, device=self.decode_seq_lens.device)

    @cached_property
    def decode_context_lens(self) -> torch.Tensor:
        return self.decode_seq_lens - 1

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool: which gathered slots are real."""
        slots = self.decode_block_tables.shape[1] * self.block_size
        key_index = torch.arange(slots, device=self.decode_seq_lens.device)
        return (key_index[None, :] < self.decode_seq_lens[:, None])[:, None, None, :]
