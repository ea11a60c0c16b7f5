"""Test tooling: GGUF files written with `gguf`'s own writer from a transformers model's state dict, laid
out as llama.cpp's converter (convert_hf_to_gguf.py) lays them out: its tensor names, its q/k row
permutation for Llama, Phi-3's fused tensors and rope factor tensors, Gemma's norms stored with the +1
added, experts stacked in 3-D tensors, its metadata keys."""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",   # Phi-3: gate and up rows in one tensor
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Gemma's four norms per layer: ffn_norm is the one before the MLP.
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA_ARCHS = ("gemma2", "gemma3")
# transformers holds each layer's experts stacked: gate and up rows in one [experts, 2 * inter, hidden] tensor.
STACKED_EXPERTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
                   "mlp.experts.down_proj": ("ffn_down_exps",)}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [2, half] -> [half, 2]."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path, arch: str, hf_config, state: dict[str, torch.Tensor],
               extra: dict[str, np.ndarray] | None = None, tokenizer_from: Path | None = None,
               quantized: str | None = None, expert_type: gguf.GGMLQuantizationType | None = None) -> None:
    """A float32 GGUF of arch (llama.cpp's architecture name), plus extra tensors named as in GGUF;
    tokenizer_from: a GGUF whose tokenizer keys are copied (so the file runs on its own); quantized: a GGML
    type (Q8_0, Q4_0, ...) its 2-D tensors are quantized to by gguf's own quantizer (gguf_round_trip);
    expert_type: the quantized type of the experts' tensors only (routed and shared; the router stays float32,
    as llama.cpp keeps it)."""
    writer = gguf.GGUFWriter(path, arch)
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    names = GGUF_NAMES | (GEMMA_NAMES if arch in GEMMA_ARCHS else {})
    if arch in GEMMA_ARCHS:
        rope = _gemma_metadata(writer, hf_config, rope, head_dim)
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_feed_forward_length(hf_config.intermediate_size)
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_head_count_kv(hf_config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(hf_config.rms_norm_eps)
    writer.add_vocab_size(hf_config.vocab_size)
    writer.add_eos_token_id(2)
    _expert_metadata(writer, hf_config)
    tensors = _rope_metadata(writer, hf_config, rope)

    def add(name: str, values: np.ndarray) -> None:
        if expert_type is not None and name.endswith("ffn_gate_inp_shexp.weight"):
            values = values.reshape(-1)   # Qwen2-MoE's [1, hidden] shared-expert gate, as quantized files hold it
        if quantized is not None and values.ndim == 2:
            kind = gguf.GGMLQuantizationType[quantized]
        elif expert_type is not None and ("_exps." in name or "_shexp." in name) and "_inp_" not in name:
            kind = expert_type
        else:
            kind = None
        if kind is None:
            writer.add_tensor(name, np.ascontiguousarray(values))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and hf_config.tie_word_embeddings:
            continue   # the converter writes no output tensor for a tied head
        stem, kind = hf_name.rsplit(".", 1)
        values = tensor.float().numpy()
        if arch in GEMMA_ARCHS and hf_name.endswith("norm.weight"):
            values = values + 1
        if (stacked := hf_name.split(".", 3)[-1]) in STACKED_EXPERTS:
            layer = hf_name.split(".")[2]
            for part, name in zip(np.split(values, len(STACKED_EXPERTS[stacked]), axis=1), STACKED_EXPERTS[stacked]):
                add(f"blk.{layer}.{name}.weight", part)
            continue
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            name = f"blk.{layer}.{names[part]}.{kind}"
            if arch == "llama" and part == "self_attn.q_proj":
                values = llama_cpp_permute(values, hf_config.num_attention_heads)
            elif arch == "llama" and part == "self_attn.k_proj":
                values = llama_cpp_permute(values, hf_config.num_key_value_heads)
        else:
            name = f"{names[stem]}.{kind}"
        add(name, values)
    for name, values in {**tensors, **(extra or {})}.items():
        writer.add_tensor(name, values)
    if tokenizer_from is not None:
        for key, field in gguf.GGUFReader(tokenizer_from).fields.items():
            if key.startswith("tokenizer."):
                sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_round_trip(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """A weight as a GGUF of that type holds it: quantized and dequantized by gguf's own code."""
    kind = gguf.GGMLQuantizationType[type_name]
    values = gguf.quants.dequantize(gguf.quants.quantize(weight.float().numpy(), kind), kind)
    return torch.from_numpy(values.reshape(weight.shape).copy())


def _gemma_metadata(writer: gguf.GGUFWriter, hf_config, rope: dict, head_dim: int) -> dict:
    """Gemma 2/3's keys as Gemma2Model/Gemma3Model write them: soft-caps, the window, the layer pattern (a flag
    per layer), the local rope base; and attention.scale where query_pre_attn_scalar is not llama.cpp's
    assumption (head_dim). Returns the full-attention layers' rope parameters."""
    for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                     ("final_logit_softcapping", writer.add_final_logit_softcapping)):
        if getattr(hf_config, key, None) is not None:
            add(getattr(hf_config, key))
    writer.add_sliding_window(hf_config.sliding_window)
    if hf_config.model_type != "gemma2":
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in hf_config.layer_types])
    if hf_config.query_pre_attn_scalar != head_dim:
        writer.add_attention_scale(hf_config.query_pre_attn_scalar ** -0.5)
    if "full_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        return rope["full_attention"]
    return rope


def _expert_metadata(writer: gguf.GGUFWriter, hf_config) -> None:
    """The expert keys of Mixtral (whose feed_forward_length is each expert's), Qwen2-MoE and Qwen3-MoE."""
    num_experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if not num_experts:
        return
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(hf_config.num_experts_per_tok)
    if getattr(hf_config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(hf_config.moe_intermediate_size)
    if getattr(hf_config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(hf_config.shared_expert_intermediate_size)


def _rope_metadata(writer: gguf.GGUFWriter, hf_config, rope: dict) -> dict[str, np.ndarray]:
    """Rope scaling keys as the converter writes them; returns the tensors it adds (longrope's factors)."""
    kind = rope.get("rope_type", "default")
    if kind == "longrope":   # Phi3MiniModel: the attention factor computed, the factors as tensors
        original = hf_config.original_max_position_embeddings
        scale = hf_config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_rope_scaling_orig_ctx_len(original)
        return {"rope_factors_long.weight": np.asarray(rope["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.asarray(rope["short_factor"], dtype=np.float32)}
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    return {}
