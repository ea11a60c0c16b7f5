"""Non-causal (encoder) attention: every token of a sequence attends to all of that sequence's tokens.

The pooling runner computes an encoder prompt whole, in one step, never in chunks (the engine raises its
token budget to max_model_len for that), so a sequence's own new q/k/v are its entire context and torch's
SDPA serves without reading the cache back. The K/V are still written into the sequence's blocks, which
the KV manager allocated for the step and frees when it ends, so the pool's accounting is the decoder's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.attention.metadata import AttentionMetadata


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: CacheTensor,
                      v_cache: CacheTensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim] of the step's sequences, laid out one after another as
    meta.query_starts says; returns the attention output in q's shape.

    The sequences are padded to the longest into one [sequences, heads, length, head_dim] batch, the padding
    keys masked out: one SDPA call per layer for the whole step (a loop over a step's hundreds of short
    sequences cost more than their attention)."""
    num_tokens = meta.slot_mapping.shape[0]
    meta.backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    starts = meta.query_starts
    lengths = starts[1:] - starts[:-1]
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths, output_size=num_tokens)
    position = torch.arange(num_tokens, device=q.device) - starts[sequence]

    def padded(rows: torch.Tensor) -> torch.Tensor:
        batch = rows.new_zeros(len(lengths), meta.max_query_len, *rows.shape[1:])
        batch[sequence, position] = rows
        return batch.transpose(1, 2)

    keys = torch.arange(meta.max_query_len, device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=keys[:, None, None, :],
                                         scale=scale)
    return out.transpose(1, 2)[sequence, position]
