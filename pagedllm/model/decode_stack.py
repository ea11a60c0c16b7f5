"""A decode step's decoder layers as one compiled call (csrc/decode_layers.cpp), for models whose layers the
kernels cover whole; the Python layers (llama.DecoderLayer) serve every other model and step.

Batch-1 decode of the bundled 30-layer model spent ~3.4 ms of a 10.35 ms step in Python between the ~11
kernels of each layer (module calls, pybind conversions, a new output per op, views and splits of qkv):
the compiled stack runs the same kernels, in the same order, on the same inputs, so its results are the
Python layers' bit for bit (tests/model/test_decode_stack.py holds it to that).

It covers: dense layers of quantized projections (QuantizedLinear, one rank, bare or in an adapter wrapper), RMSNorm and
silu through the kernels, rotary through its kernel, no q/k norms, sandwich norms or local rope; sliding
windows, soft-capped scores, a qkv bias and every KV cache dtype are the kernels' own arguments. A step
takes it when all its tokens are decodes (no prefill chunk, no padding rows), on the cpu attention backend,
without a cascade group, and when the quantized matmul path for its row count is a compiled one.
PAGEDLLM_DECODE_STACK=0 makes the Python layers serve every step (tests compare the two; benchmarks time both).

An adapter wrapper (pagedllm.lora.layer.LoRALinear; this layer does not import it) is a module with `base`, the plain
projection, `lora_slots`, its stacked adapters (a, b, ranks, column_starts, updated in place), `lora_kernel`, the
compiled update it calls (None: torch ops), and `lora_segments()`, the step's rows grouped by slot (None: no adapter
rows). The stack runs the same update after the projection's matmul, as the wrapper does.

A one-row step on the rows or int16 matmul path (batch-1 decode) runs all its layers, adapters included, in one OpenMP
parallel region: each thread its share of every kernel, the threads meeting at barriers (csrc/decode_layers.cpp),
where each kernel's own region cost a fork and a join, ~150 a step; the results are the same.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from pagedllm.model import kernels
from pagedllm.model.attention.cache import CacheTensor
from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.linear import QuantizedLinear
from pagedllm.model.mlp import GatedMLP
from pagedllm.model.ops import row_misfit
from pagedllm.model.quantized_matmul import QuantizedMatmul
from pagedllm.model.rope import Rotation, RotaryEmbedding

logger = logging.getLogger(__name__)

FORCE_VARIABLE = "PAGEDLLM_DECODE_STACK"


def requested() -> bool:
    """Whether PAGEDLLM_DECODE_STACK lets the stack serve (read once per model, when it is built)."""
    value = os.environ.get(FORCE_VARIABLE, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{FORCE_VARIABLE} must be 0 (the Python layers) or 1 (the compiled stack where it serves), "
                         f"got {value!r}")
    return value == "1"


def _unwrapped(projection: nn.Module) -> nn.Module:
    """The plain projection inside an adapter wrapper, or the projection itself."""
    return projection.base if hasattr(projection, "lora_slots") else projection


def _projection(layer: QuantizedLinear) -> tuple:
    return layer.qweight, layer.scales, layer.mins, layer.bias, layer.bits, layer.group_size


def _misfit(layers: nn.ModuleList, rope: RotaryEmbedding, uses_local_rope: bool, wanted: bool) -> str | None:
    """Why the compiled stack cannot run these layers (None: it can)."""
    if not wanted:
        return f"{FORCE_VARIABLE}=0"
    if kernels.kernels is None:
        return "the C++ kernels are not built"
    if rope.kernel is None:
        return "rotary embedding takes the torch path"
    if uses_local_rope:
        return "layers rotate by a local rope"
    for index, layer in enumerate(layers):
        mlp = layer.mlp
        if not isinstance(mlp, GatedMLP) or mlp.activation_name != "silu":
            return f"layer {index}'s feed-forward is not a dense silu MLP"
        wrapped = (layer.qkv_proj, layer.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(hasattr(p, "lora_slots") and p.lora_kernel is None for p in wrapped):
            return f"layer {index}'s adapters take the torch path"
        projections = tuple(_unwrapped(p) for p in wrapped)
        if not all(type(p) is QuantizedLinear and p.out_dtype is None for p in projections):
            return f"layer {index}'s projections are not all plain quantized layers (float, wrapped or split)"
        if projections[0].qweight.device.type != "cpu":
            return "not on CPU"
        if any(norm is not None for norm in (layer.q_norm, layer.attention_output_norm, layer.mlp_output_norm)):
            return f"layer {index} has q/k or sandwich norms"
        reason = row_misfit(projections[0].in_features) or row_misfit(projections[3].in_features)
        if reason:
            return reason
    return None


class DecodeStack:
    """The compiled stack over one model's layers, and the test of whether a step can take it."""

    def __init__(self, layers: nn.ModuleList, rope: RotaryEmbedding, matmul: QuantizedMatmul, eps: float):
        first = layers[0]
        self.matmul = matmul
        self.dtype = first.input_norm.weight.dtype
        self.stack = kernels.kernels.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim,
                                                 rope.rotary_dim, eps)
        self.adapter_wrapper = None   # any one adapter wrapper: they share the step's row grouping
        for index, layer in enumerate(layers):
            mlp = layer.mlp
            wrapped = (layer.qkv_proj, layer.o_proj, mlp.gate_up_proj, mlp.down_proj)
            projections = tuple(_unwrapped(p) for p in wrapped)
            args = [part for p in projections for part in (_projection(p), p.out_features)]
            self.stack.add_layer(layer.input_norm.weight, layer.pre_mlp_norm.weight, *args, layer.attention.scale,
                                 *layer.attention.kernel_limits())
            for position, wrapper in enumerate(wrapped):
                if hasattr(wrapper, "lora_slots"):
                    self.stack.set_lora(index, position, *wrapper.lora_slots)
                    self.adapter_wrapper = wrapper

    @classmethod
    def build(cls, layers: nn.ModuleList, rope: RotaryEmbedding, matmul: QuantizedMatmul, eps: float,
              uses_local_rope: bool, wanted: bool) -> DecodeStack | None:
        """The stack, or None (logged with the reason) where the Python layers must serve every step.
        wanted: requested()'s answer when the model was built."""
        reason = _misfit(layers, rope, uses_local_rope, wanted)
        if reason is not None:
            logger.info("decode steps run the Python layers (%s)", reason)
            return None
        return cls(layers, rope, matmul, eps)

    def path(self, meta: AttentionMetadata, num_tokens: int) -> str | None:
        """The quantized matmul path the stack runs this step with, or None where the step needs the Python
        layers: a prefill chunk or padding rows, another attention backend, a cascade group, the torch matmul."""
        if (meta.num_decode_tokens != num_tokens or meta.slot_mapping.shape[0] != num_tokens
                or meta.backend is None or meta.backend.name != "cpu" or meta.decode_cascade is not None):
            return None
        path = self.matmul.path(self.dtype, num_tokens)
        return None if path == "torch" else path

    def forward(self, hidden: torch.Tensor, rotation: Rotation, kv_caches: list[tuple[CacheTensor, CacheTensor]],
                meta: AttentionMetadata, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream before it), as the Python layers return them."""
        k_caches, v_caches = zip(*kv_caches)
        segments = None if self.adapter_wrapper is None else self.adapter_wrapper.lora_segments()
        rows, table = (None, None) if segments is None else segments
        return self.stack.forward(hidden, rotation.rows, rotation.table, meta.slot_mapping, meta.decode_block_tables,
                                  meta.decode_rows, meta.decode_seq_lens, [c.data for c in k_caches],
                                  [c.data for c in v_caches], [c.scales for c in k_caches],
                                  [c.scales for c in v_caches], path, rows, table)
