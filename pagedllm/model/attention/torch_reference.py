"""The `torch` attention backend, the reference: each row's blocks gathered (dequantized) and attended by
SDPA; any device, any layout, sliding windows and soft-capping included."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.model.attention.cache import CacheTensor, gather, write_kv_reference
from pagedllm.model.attention.metadata import AttentionMetadata, LayerAttention
from pagedllm.model.attention.paged import DecodePrefillBackend


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                        layer: LayerAttention) -> torch.Tensor:
    """SDPA, or with soft-capping (which SDPA cannot do) the same in plain operations.
    q: [..., heads, queries, head_dim]; keys, values: [..., kv_heads, keys, head_dim]; visible: a bool mask
    broadcasting to [..., queries, keys] (None: causal over the last queries)."""
    if layer.logit_softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, is_causal=visible is None,
                                              scale=layer.scale, enable_gqa=True)
    group = q.shape[-3] // keys.shape[-3]
    keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = (q @ keys.transpose(-1, -2)) * layer.scale
    scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
    if visible is None:
        num_queries, num_keys = scores.shape[-2:]
        visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(num_keys - num_queries)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values


class TorchAttentionBackend(DecodePrefillBackend):
    name = "torch"

    def write_kv(self, k_cache: CacheTensor, v_cache: CacheTensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv_reference(k_cache, v_cache, k, v, slot_mapping)

    def decode(self, out, q, k_cache, v_cache, meta: AttentionMetadata, layer: LayerAttention) -> None:
        keys, values = gather(k_cache, v_cache, meta.decode_block_tables, q.dtype)
        visible = meta.decode_mask
        if layer.sliding_window is not None:
            key_index = torch.arange(visible.shape[-1], device=q.device)
            visible = visible & (key_index >= (meta.decode_seq_lens - layer.sliding_window)[:, None, None, None])
        out.copy_(reference_attention(q.unsqueeze(2), keys, values, visible, layer).squeeze(2))

    def prefill(self, out, q, k, v, k_cache, v_cache, meta: AttentionMetadata, layer: LayerAttention) -> None:
        exact_cache = k_cache.data.dtype == k.dtype   # the cache holds the new K/V as they are
        starts = meta.prefill_query_starts.tolist()
        for chunk, context in enumerate(meta.prefill_context_lens.tolist()):
            start, end = starts[chunk], starts[chunk + 1]
            query = q[start:end].transpose(0, 1)
            length = context + end - start
            whole_sequence = context == 0 and exact_cache   # all in this chunk: its own K/V suffice
            if whole_sequence:
                keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                blocks = meta.prefill_block_tables[chunk, :-(-length // meta.block_size)]
                keys, values = (part[:, :length] for part in gather(k_cache, v_cache, blocks, q.dtype))
            visible = None   # causal
            if not whole_sequence or layer.sliding_window is not None:
                positions = torch.arange(context, length, device=q.device)[:, None]
                key_index = torch.arange(length, device=q.device)[None, :]
                visible = key_index <= positions
                if layer.sliding_window is not None:
                    visible &= key_index > positions - layer.sliding_window
            # A batch dimension of one: with it PyTorch's flash-attention kernel serves (GQA too).
            out[start:end] = reference_attention(query[None], keys[None], values[None], visible,
                                                 layer)[0].transpose(0, 1)
