"""BERT-family encoders (BertModel, RobertaModel, XLMRobertaModel and their *ForSequenceClassification):
post-norm layers with non-causal attention, run through the engine's paged prefill for pooling.

A prompt's token types (segment A / B of a pair) ride in its token ids above TOKEN_TYPE_SHIFT, so they
travel through the scheduler and the persistent batch unchanged (vLLM does the same); the embedding
layer splits them apart again.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.attention.metadata import AttentionMetadata, LayerAttention
from pagedllm.model.encoder_attention import encoder_attention
from pagedllm.model.linear import Linear
from pagedllm.model.llama import CausalLM, WeightTaker
from pagedllm.model.pooler import Pooler

TOKEN_TYPE_SHIFT = 24   # token ids stay below 2**24 (the largest vocabularies have ~260k entries)
_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def with_token_types(token_ids: list[int], token_type_ids: list[int]) -> list[int]:
    """Token ids carrying their token types (see the module docstring)."""
    return [token | (kind << TOKEN_TYPE_SHIFT) for token, kind in zip(token_ids, token_type_ids)]


@dataclass(frozen=True)
class EncoderConfig:
    """What a BERT-family config.json says beyond ModelConfig's shared fields."""
    prefix: str                 # "" for the bare model, "bert." / "roberta." under a classification head
    type_vocab_size: int
    position_offset: int        # RoBERTa family: positions start after the padding index
    layer_norm_eps: float
    hidden_act: str
    head: str | None            # None, "bert" (pooler + classifier) or "roberta" (classifier.dense + out_proj)

    @classmethod
    def from_hf(cls, config: Mapping, family: str, classifies: bool) -> EncoderConfig:
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type must be 'absolute', got {config['position_embedding_type']!r}")
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {', '.join(_ACTIVATIONS)}, got {act!r}")
        roberta = family != "bert"
        return cls(prefix=f"{family}." if classifies else "", type_vocab_size=config.get("type_vocab_size", 2),
                   position_offset=config.get("pad_token_id", 1) + 1 if roberta else 0,
                   layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)), hidden_act=act,
                   head=("roberta" if roberta else "bert") if classifies else None)


def encoder_weight_shapes(hidden: int, intermediate: int, num_layers: int, vocab_size: int, max_positions: int,
                          encoder: EncoderConfig, num_labels: int) -> dict[str, tuple[int, ...]]:
    """Every tensor the encoder reads, by its checkpoint name."""
    p = encoder.prefix
    shapes = {p + "embeddings.word_embeddings.weight": (vocab_size, hidden),
              p + "embeddings.position_embeddings.weight": (max_positions, hidden),
              p + "embeddings.token_type_embeddings.weight": (encoder.type_vocab_size, hidden)}
    shapes |= _norm_shapes(p + "embeddings.LayerNorm", hidden)
    for layer in range(num_layers):
        at = f"{p}encoder.layer.{layer}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes |= _linear_shapes(at + name, hidden, hidden)
        shapes |= _linear_shapes(at + "intermediate.dense", intermediate, hidden)
        shapes |= _linear_shapes(at + "output.dense", hidden, intermediate)
        shapes |= _norm_shapes(at + "attention.output.LayerNorm", hidden) | _norm_shapes(at + "output.LayerNorm", hidden)
    if encoder.head == "bert":
        shapes |= _linear_shapes(p + "pooler.dense", hidden, hidden) | _linear_shapes("classifier", num_labels, hidden)
    elif encoder.head == "roberta":
        shapes |= _linear_shapes("classifier.dense", hidden, hidden)
        shapes |= _linear_shapes("classifier.out_proj", num_labels, hidden)
    return shapes


def encoder_unused(name: str) -> bool:
    """Tensors an encoder checkpoint may carry that pooling does not read: the bare model's pooler
    (sentence-transformers pools the token states instead) and stored position-id buffers."""
    return ".pooler." in f".{name}" or name.endswith("position_ids")


def _linear_shapes(name: str, rows: int, columns: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (rows, columns), f"{name}.bias": (rows,)}


def _norm_shapes(name: str, size: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (size,), f"{name}.bias": (size,)}


class LayerNorm(nn.Module):
    def __init__(self, w: WeightTaker, name: str, eps: float):
        super().__init__()
        self.register_buffer("weight", w(name + ".weight"))
        self.register_buffer("bias", w(name + ".bias"))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def _linear(w: WeightTaker, name: str) -> Linear:
    return Linear(w(name + ".weight"), w(name + ".bias"))


class EncoderLayer(nn.Module):
    def __init__(self, w: WeightTaker, prefix: str, num_heads: int, encoder: EncoderConfig):
        super().__init__()
        attn = prefix + "attention."
        self.qkv = Linear(torch.cat([w(f"{attn}self.{n}.weight") for n in ("query", "key", "value")]),
                          torch.cat([w(f"{attn}self.{n}.bias") for n in ("query", "key", "value")]))
        self.attention_out = _linear(w, attn + "output.dense")
        self.attention_norm = LayerNorm(w, attn + "output.LayerNorm", encoder.layer_norm_eps)
        self.intermediate = _linear(w, prefix + "intermediate.dense")
        self.output = _linear(w, prefix + "output.dense")
        self.output_norm = LayerNorm(w, prefix + "output.LayerNorm", encoder.layer_norm_eps)
        self.activation = _ACTIVATIONS[encoder.hidden_act]
        self.num_heads = num_heads

    def forward(self, hidden: torch.Tensor, kv_cache: tuple[CacheTensor, CacheTensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, size = hidden.shape
        head_dim = size // self.num_heads
        q, k, v = (part.view(num_tokens, self.num_heads, head_dim) for part in self.qkv(hidden).chunk(3, dim=-1))
        attn = encoder_attention(q, k, v, kv_cache[0], kv_cache[1], meta, head_dim ** -0.5)
        hidden = self.attention_norm(self.attention_out(attn.reshape(num_tokens, size)) + hidden)
        return self.output_norm(self.output(self.activation(self.intermediate(hidden))) + hidden)


class EncoderPoolingModel(nn.Module):
    """A BERT-family encoder that returns one pooled row per sequence: the embedding before its finish, or
    with a classification head the head's float32 logits."""

    weight_summary = CausalLM.weight_summary
    weight_bytes = CausalLM.weight_bytes

    def __init__(self, config, encoder: EncoderConfig, weights: Mapping, dtype: torch.dtype, device: torch.device,
                 pooler: Pooler):
        super().__init__()
        self.config, self.encoder, self.pooler = config, encoder, pooler
        self.num_kv_heads = config.num_key_value_heads
        w = WeightTaker(weights, dtype, device)
        p = encoder.prefix + "embeddings."
        self.word_embeddings = nn.Parameter(w(p + "word_embeddings.weight"), requires_grad=False)
        self.position_embeddings = nn.Parameter(w(p + "position_embeddings.weight"), requires_grad=False)
        self.token_type_embeddings = nn.Parameter(w(p + "token_type_embeddings.weight"), requires_grad=False)
        self.embedding_norm = LayerNorm(w, p + "LayerNorm", encoder.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(w, f"{encoder.prefix}encoder.layer.{i}.", config.num_attention_heads,
                                                 encoder) for i in range(config.num_hidden_layers))
        # What the runner's backend choice reads: full attention, no window or soft-cap (SDPA runs it, non-causal).
        self.attention_layers = tuple(LayerAttention(config.head_dim ** -0.5) for _ in self.layers)
        self.has_quantized_layers = False   # encoders load float safetensors only
        if encoder.head == "bert":
            self.head_dense, self.head_out = _linear(w, encoder.prefix + "pooler.dense"), _linear(w, "classifier")
        elif encoder.head == "roberta":
            self.head_dense, self.head_out = _linear(w, "classifier.dense"), _linear(w, "classifier.out_proj")

    def forward_pooled(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[tuple[CacheTensor, CacheTensor]], meta: AttentionMetadata,
                       starts: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        """input_ids carry token types (with_token_types); every sequence is whole in the step."""
        token_ids, token_types = input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1), input_ids >> TOKEN_TYPE_SHIFT
        hidden = self.embedding_norm(F.embedding(token_ids, self.word_embeddings)
                                     + F.embedding(positions + self.encoder.position_offset, self.position_embeddings)
                                     + F.embedding(token_types, self.token_type_embeddings))
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, kv_cache, meta)
        rows = torch.from_numpy(self.pooler.rows(starts, lengths)).to(hidden.device)
        if self.encoder.head is None:
            return self.pooler.reduce(hidden[rows], lengths)
        # Both heads read the first token (BERT's pooler, RoBERTa's classification head).
        return self.head_out(torch.tanh(self.head_dense(hidden[rows]))).float()
