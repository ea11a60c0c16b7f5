"""Decoder models run for pooling (Qwen3-Embedding-style embedders, *ForSequenceClassification rerankers):
the causal stack without its LM head, pooled per sequence, with a classification (score) head if any."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.config import ModelConfig
from pagedllm.model.linear import fused_linear
from pagedllm.model.llama import CausalLM, WeightTaker
from pagedllm.model.pooler import Pooler


class DecoderPoolingModel(CausalLM):
    def __init__(self, config: ModelConfig, weights: Mapping, dtype: torch.dtype, device: torch.device,
                 max_positions: int, pooler: Pooler, num_labels: int):
        super().__init__(config, weights, dtype, device, max_positions, with_lm_head=False)
        self.pooler = pooler
        self.score = fused_linear([WeightTaker(weights, dtype, device)("score.weight")]) if num_labels else None

    def forward_pooled(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[tuple[CacheTensor, CacheTensor]], meta: AttentionMetadata,
                       starts: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        """One float32 row per sequence: the pooled hidden state, or the score head's logits on it."""
        rows = torch.from_numpy(self.pooler.rows(starts, lengths)).to(input_ids.device)
        hidden = self.hidden_states(input_ids, positions, kv_caches, meta, rows)
        pooled = self.pooler.reduce(hidden, lengths)
        return pooled if self.score is None else self.score(pooled.to(hidden.dtype)).float()
