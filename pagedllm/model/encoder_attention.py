"""Non-causal (encoder) attention: every token of a sequence attends to all of that sequence's tokens.

The pooling runner computes an encoder prompt whole, in one step, never in chunks (the engine raises its
token budget to max_model_len for that), so a sequence's own new q/k/v are its entire context and torch's
SDPA serves without reading the cache back. The K/V are still written into the sequence's blocks, which
the KV manager allocated for the step and frees when it ends, so the pool's accounting is the decoder's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.model.attention import AttentionMetadata, CacheTensor, write_kv


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: CacheTensor,
                      v_cache: CacheTensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim] of the step's sequences, laid out one after another as
    meta.query_starts says; returns the attention output in q's shape."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    starts = meta.query_starts.tolist()
    for start, end in zip(starts, starts[1:]):
        rows = slice(start, end)
        # A batch dimension of one: PyTorch's flash-attention kernel serves.
        out[rows] = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                                                   v[rows].transpose(0, 1)[None], is_causal=False,
                                                   scale=scale)[0].transpose(0, 1)
    return out
