"""Test tooling: GGUF files written with `gguf`'s own writer from a transformers model's state dict, laid
out as llama.cpp's converter (convert_hf_to_gguf.py) lays them out: its tensor names, its q/k row
permutation for Llama, Phi-3's fused tensors and rope factor tensors, experts stacked in 3-D tensors, its
metadata keys."""
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
# transformers holds each layer's experts stacked: gate and up rows in one [experts, 2 * inter, hidden] tensor.
STACKED_EXPERTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
                   "mlp.experts.down_proj": ("ffn_down_exps",)}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [2, half] -> [half, 2]."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path, arch: str, hf_config, state: dict[str, torch.Tensor],
               extra: dict[str, np.ndarray] | None = None, tokenizer_from: Path | None = None,
               expert_type: gguf.GGMLQuantizationType | None = None) -> None:
    """A float32 GGUF of arch (llama.cpp's architecture name), plus extra tensors named as in GGUF;
    tokenizer_from: a GGUF whose tokenizer keys are copied (so the file runs on its own); expert_type: the
    quantized type of the experts' tensors (routed and shared; the router stays float32, as llama.cpp keeps it)."""
    writer = gguf.GGUFWriter(path, arch)
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
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
        if expert_type is not None and ("_exps." in name or "_shexp." in name) and "_inp_" not in name:
            writer.add_tensor(name, gguf.quants.quantize(values, expert_type), raw_dtype=expert_type)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values))

    for hf_name, tensor in state.items():
        stem, kind = hf_name.rsplit(".", 1)
        values = tensor.float().numpy()
        if (stacked := hf_name.split(".", 3)[-1]) in STACKED_EXPERTS:
            layer = hf_name.split(".")[2]
            for part, name in zip(np.split(values, len(STACKED_EXPERTS[stacked]), axis=1), STACKED_EXPERTS[stacked]):
                add(f"blk.{layer}.{name}.weight", part)
            continue
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            name = f"blk.{layer}.{GGUF_NAMES[part]}.{kind}"
            if arch == "llama" and part == "self_attn.q_proj":
                values = llama_cpp_permute(values, hf_config.num_attention_heads)
            elif arch == "llama" and part == "self_attn.k_proj":
                values = llama_cpp_permute(values, hf_config.num_key_value_heads)
        else:
            name = f"{GGUF_NAMES[stem]}.{kind}"
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
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    return {}
