"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE) as one module.

The variants differ only in flags of ModelConfig: q/k/v bias (Qwen2), per-head
q/k RMSNorm (Qwen3, Gemma 3), rope scaling (Llama 3.1), tied embeddings, and sparse feed-forward layers
(ModelConfig.moe; moe.py); Gemma adds GeGLU, a scaled embedding, norms on the attention and MLP outputs
("sandwich"), soft-capped attention scores and logits, and (Gemma 3) its own rope base for the sliding
layers. Q/K/V and
gate/up projections are fused at load time so each layer does two big matmuls
instead of five; on CPUs with fast bfloat16 float weights are laid out once for oneDNN, and
quantized weights stay packed (see linear.py). Weights are taken from the checkpoint one at a
time, each straight into its final form, so loading never holds a second copy of the model.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import SINGLE_PROCESS, TensorParallelGroup
from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.attention.metadata import AttentionMetadata, LayerAttention
from pagedllm.model.config import ModelConfig
from pagedllm.model.decode_stack import DecodeStack, requested as decode_stack_requested
from pagedllm.model.weight_placement import place_on_huge_pages
from pagedllm.model.linear import Embedding, Linear, QuantizedLinear, fused_linear, padded_rows
from pagedllm.model.mlp import GatedMLP
from pagedllm.model.moe import SparseMoeBlock
from pagedllm.model.moe_config import is_sparse
from pagedllm.model.ops import rms_norm_op
from pagedllm.model.parallel_linear import parallel_lm_head, row_parallel, vocab_parallel_embedding
from pagedllm.model.quantization import QuantizedWeight
from pagedllm.model.quantized_matmul import QuantizedMatmul
from pagedllm.model.rope import Rotation, RotaryEmbedding
from pagedllm.model.tensor_parallel import num_kv_heads_per_rank


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class WeightTaker:
    """Reads checkpoint tensors one by one: float ones in the model's dtype and device, quantized ones as they are."""

    def __init__(self, weights: Mapping[str, torch.Tensor | QuantizedWeight], dtype: torch.dtype,
                 device: torch.device):
        self.weights, self.dtype, self.device = weights, dtype, device

    def __call__(self, name: str) -> torch.Tensor | QuantizedWeight:
        weight = self.weights[name]
        if isinstance(weight, QuantizedWeight):
            return weight.to(self.device)
        return weight.to(dtype=self.dtype, device=self.device)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = _frozen(weight)
        self.eps = eps
        self.rms_norm = rms_norm_op(weight.device, weight.shape[-1])   # the kernel or torch's, chosen here

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With residual: residual += x in place first, and the sum is normalised."""
        return self.rms_norm(x, self.weight, self.eps, residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, w: WeightTaker, layer: int, group: TensorParallelGroup,
                 sliding_window: int | None, matmul: QuantizedMatmul):
        super().__init__()
        self.num_heads = config.num_attention_heads // group.world_size   # this rank's heads
        self.num_kv_heads = num_kv_heads_per_rank(config, group.world_size)
        self.head_dim = config.head_dim
        prefix = f"model.layers.{layer}."
        self.local_rope = config.uses_local_rope(layer)   # rotates by the model's local rope (Gemma 3's sliding layers)
        self.attention = LayerAttention(config.attention_scale, sliding_window, config.attn_logit_softcapping)
        attn = prefix + "self_attn."
        self.qkv_proj = fused_linear([w(attn + n + "_proj.weight") for n in "qkv"],
                                     [w(attn + n + "_proj.bias") for n in "qkv"] if config.attention_bias else None,
                                     matmul)
        self.o_proj = row_parallel(fused_linear([w(attn + "o_proj.weight")], matmul=matmul), group)
        self.q_norm = RMSNorm(w(attn + "q_norm.weight"), config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(w(attn + "k_norm.weight"), config.rms_norm_eps) if config.qk_norm else None
        self.mlp = (SparseMoeBlock(config.moe, w, prefix + "mlp.", group, matmul) if is_sparse(config.moe, layer)
                    else GatedMLP(w, prefix + "mlp.", matmul, group, config.hidden_activation))

        def norm(name: str) -> RMSNorm:
            return RMSNorm(w(f"{prefix}{name}.weight"), config.rms_norm_eps)

        self.input_norm = norm("input_layernorm")
        # With sandwich norms (Gemma) post_attention_layernorm is the attention output's, and the MLP has two.
        self.attention_output_norm = norm("post_attention_layernorm") if config.sandwich_norms else None
        self.pre_mlp_norm = norm("pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm")
        self.mlp_output_norm = norm("post_feedforward_layernorm") if config.sandwich_norms else None

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rotation: Rotation,
                kv_cache: tuple[CacheTensor, CacheTensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it); their sum is the
        layer's result, added into the stream by the next norm in the same pass."""
        num_tokens = hidden.shape[0]
        if residual is None:
            residual, normed = hidden, self.input_norm(hidden)
        else:
            normed = self.input_norm(hidden, residual)
        qkv = self.qkv_proj(normed)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotation.apply(q), rotation.apply(k)
        attn = meta.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.attention)
        attn = self.o_proj(attn.reshape(num_tokens, q_size))
        if self.attention_output_norm is not None:
            attn = self.attention_output_norm(attn)
        out = self.mlp(self.pre_mlp_norm(attn, residual))
        if self.mlp_output_norm is not None:
            out = self.mlp_output_norm(out)
        return out, residual


class CausalLM(nn.Module):
    """Runs a flat batch of tokens from many sequences; returns logits only where asked.

    Under tensor parallelism (group of more than one rank) `weights` reads as this rank's parts
    (CheckpointWeights.sharded) and the logits come back on rank 0 only. Without an LM head
    (with_lm_head False: pooling models) only hidden_states serves. matmul: the kernels of the
    quantized layers (quantized_matmul.py; default: float activations, the fastest path per row count).
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor | QuantizedWeight],
                 dtype: torch.dtype, device: torch.device, max_positions: int,
                 group: TensorParallelGroup = SINGLE_PROCESS, with_lm_head: bool = True,
                 matmul: QuantizedMatmul | None = None):
        super().__init__()
        self.config = config
        self.matmul = matmul = matmul or QuantizedMatmul()
        self.num_kv_heads = num_kv_heads_per_rank(config, group.world_size)
        w = WeightTaker(weights, dtype, device)
        embedding = w("model.embed_tokens.weight")
        self.embed_tokens = vocab_parallel_embedding(Embedding(embedding, dtype), group, config.vocab_size)
        self.lm_head = parallel_lm_head(
            fused_linear([embedding if config.tie_word_embeddings else w("lm_head.weight")], matmul=matmul,
                         float_output=True),
            group) if with_lm_head else None
        del embedding
        self.layers = nn.ModuleList(
            DecoderLayer(config, w, i, group, window, matmul)
            for i, window in enumerate(config.windows_within(max_positions)))
        self.attention_layers = tuple(layer.attention for layer in self.layers)
        self.norm = RMSNorm(w("model.norm.weight"), config.rms_norm_eps)
        self.rope = RotaryEmbedding(config.rotary_dim, max_positions, config.rope_theta,
                                    config.rope_scaling, device)
        self.local_rope = None if config.local_rope_theta is None else RotaryEmbedding(
            config.rotary_dim, max_positions, config.local_rope_theta, None, device)
        # (a prepacked LM head pads its own rows: only the layers' matmuls make the whole batch worth padding)
        self.pads_batch = any(isinstance(module, Linear) and module.prepacked for module in self.layers.modules())
        self.has_quantized_layers = any(isinstance(module, QuantizedLinear) for module in self.modules())
        self._check_matmul_options()
        self.weight_placement = place_on_huge_pages(self)
        self._decode_stack: DecodeStack | None | bool = False   # False: not built yet (decode_stack())
        self._decode_stack_wanted = decode_stack_requested()

    def _check_matmul_options(self) -> None:
        """activation_dtype and batch_invariant act on quantized layers: refused where there are none to act on."""
        float_layers = [name for name, module in self.named_modules() if isinstance(module, Linear)]
        if self.matmul.activation_dtype in ("int16", "int8") and not self.has_quantized_layers:
            raise ValueError(f"activation_dtype {self.matmul.activation_dtype!r} multiplies quantized weights, and this "
                             "model has none: use quantization int8 or int4, or a quantized GGUF")
        if self.matmul.batch_invariant and float_layers:
            raise ValueError(f"batch_invariant=True covers quantized layers (one row kernel for every batch), and "
                             f"{float_layers[0]} holds float weights, whose oneDNN/BLAS matmuls round by batch shape: "
                             f"use quantization int8 or int4, or a quantized GGUF")

    def decode_stack(self) -> DecodeStack | None:
        """The layers as one compiled call for decode steps (decode_stack.py), or None. Built at the first
        decode step, after the engine has put any wrappers (LoRA) around the layers, which it does at start-up."""
        if self._decode_stack is False:
            uses_local_rope = self.local_rope is not None and any(layer.local_rope for layer in self.layers)
            self._decode_stack = DecodeStack.build(self.layers, self.rope, self.matmul, self.config.rms_norm_eps,
                                                   uses_local_rope, self._decode_stack_wanted)
        return self._decode_stack

    def weight_summary(self) -> str:
        """Each kind of layer's weight format and the bytes of weights held, for the start-up log."""
        kinds: dict[str, set[str]] = {}
        for name, module in self.named_modules():
            if isinstance(module, (Linear, QuantizedLinear, Embedding)) and not name.endswith(".table"):
                kind = next(part for part in name.split(".")
                            if part not in ("layers", "parts", "mlp") and not part.isdigit())
                kinds.setdefault(kind, set()).add(module.format)
        formats = ", ".join(f"{kind} {'/'.join(sorted(found))}" for kind, found in kinds.items())
        return f"{formats}; {self.weight_bytes() / 2**20:.1f} MiB of weights"

    def weight_bytes(self) -> int:
        """Bytes of the storages behind the parameters and buffers, each once: a tied embedding shared by
        two layers counts what it holds. oneDNN's prepacked weights have no plain storage: their own bytes."""
        held = {}
        for tensor in [*self.parameters(), *self.buffers()]:
            if tensor.is_mkldnn:
                held[("prepacked", id(tensor))] = tensor.nbytes
            else:
                held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return sum(held.values())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[CacheTensor, CacheTensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor, rope_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Returns float32 logits [len(logits_indices), vocab] for the rows that sample (None on ranks > 0).
        rope_lengths: each token's sequence length for rope kinds that depend on it (RotaryEmbedding.at)."""
        logits = self.lm_head(self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices, rope_lengths))
        if logits is None:
            return None
        cap = self.config.final_logit_softcapping
        return logits.float() if cap is None else torch.tanh(logits.float() / cap) * cap

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[CacheTensor, CacheTensor]], meta: AttentionMetadata,
                      rows: torch.Tensor, rope_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output [len(rows), hidden] at the given token rows of the step."""
        if self.pads_batch:
            # Prepacked Linears take a few row counts only (see padded_rows): padding the batch once
            # here spares each of them a copy. Extra rows are token 0 at position 0; attention skips them.
            padding = padded_rows(input_ids.shape[0]) - input_ids.shape[0]
            input_ids, positions = F.pad(input_ids, (0, padding)), F.pad(positions, (0, padding))
            rope_lengths = None if rope_lengths is None else F.pad(rope_lengths, (0, padding))
        hidden, residual = self.embed_tokens(input_ids), None
        if self.config.embedding_multiplier != 1.0:   # in the model dtype, as transformers rounds it
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        rotation = self.rope.at(positions, rope_lengths)
        stack = self.decode_stack() if meta.num_decode_tokens else None
        path = None if stack is None else stack.path(meta, hidden.shape[0])
        if path is not None:
            hidden, residual = stack.forward(hidden, rotation, kv_caches, meta, path)
            return self.norm(hidden[rows], residual[rows])
        local_rotation = None if self.local_rope is None else self.local_rope.at(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, local_rotation if layer.local_rope else rotation, kv_cache, meta)
        return self.norm(hidden[rows], residual[rows])
