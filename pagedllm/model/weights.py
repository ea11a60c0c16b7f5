"""Read checkpoint tensors into a dict keyed by Hugging Face parameter names, checked against a config."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import safetensors
import torch
from safetensors.torch import load_file

from pagedllm.model.config import ModelConfig

_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GGUF_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")
_SHOWN_NAMES = 5


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, with its HF name and shape; the single source for all weight checks."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (q_size, hidden),
            prefix + "self_attn.k_proj.weight": (kv_size, hidden),
            prefix + "self_attn.v_proj.weight": (kv_size, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_size),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                prefix + "self_attn.q_proj.bias": (q_size,),
                prefix + "self_attn.k_proj.bias": (kv_size,),
                prefix + "self_attn.v_proj.bias": (kv_size,),
            }
        if config.qk_norm:
            shapes |= {
                prefix + "self_attn.q_norm.weight": (head_dim,),
                prefix + "self_attn.k_norm.weight": (head_dim,),
            }
    return shapes


def validate_weights(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Return the tensors the model reads; ValueError if one is missing, mis-shaped, or a stray tensor
    would be silently ignored (e.g. a bias the config does not declare)."""
    expected = expected_weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ValueError(f"Checkpoint is missing {len(missing)} weight(s): {_first_names(missing)}")
    unexpected = [name for name in weights if name not in expected and not _is_redundant(name, config)]
    if unexpected:
        raise ValueError(
            f"Checkpoint has {len(unexpected)} weight(s) the model does not use: {_first_names(unexpected)}"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"Weight {name} has shape {tuple(weights[name].shape)}, expected {shape}")
    return {name: weights[name] for name in expected}


def load_safetensors_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Read model.safetensors, or every shard model.safetensors.index.json names, keeping stored dtypes."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights |= load_file(folder / file)
        except safetensors.SafetensorError as exc:
            raise ValueError(f"{folder / file} is not a readable safetensors file: {exc}") from exc
    return weights


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file; the reader's low-level failures on damaged files become a ValueError naming it."""
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc


def read_gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """GGUF key/values as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def load_gguf_weights(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its HF name and shape, with llama.cpp's q/k row
    permutation undone."""
    weights = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(f"GGUF tensor {tensor.name}: {exc}") from exc
        if not values.flags.writeable:
            # F32 tensors come back as read-only views of the memory-mapped file; tensors must own memory.
            values = values.copy()
        weights[name] = torch.from_numpy(values.reshape([int(dim) for dim in reversed(tensor.shape)]))
    weights = validate_weights(weights, config)
    if config.architecture == "llama":
        for name, tensor in weights.items():
            if ".self_attn.q_proj." in name:
                weights[name] = _unpermute_rotary_rows(tensor, config.num_attention_heads)
            elif ".self_attn.k_proj." in name:
                weights[name] = _unpermute_rotary_rows(tensor, config.num_key_value_heads)
    return weights


def _hf_name(gguf_name: str) -> str:
    if block := _GGUF_BLOCK_TENSOR.fullmatch(gguf_name):
        layer, part, kind = block.groups()
        if part in _GGUF_BLOCK_NAMES:
            return f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{kind}"
    elif (single := _GGUF_GLOBAL_TENSOR.fullmatch(gguf_name)) and single.group(1) in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[single.group(1)]}.{single.group(2)}"
    raise ValueError(f"Unknown GGUF tensor {gguf_name!r}")


def _unpermute_rotary_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from HF's half-split rotary layout to interleaved
    pairs (rows viewed as [head, 2, half] become [head, half, 2]); swap them back."""
    half = tensor.shape[0] // num_heads // 2
    rows = tensor.reshape(num_heads, half, 2, *tensor.shape[1:])
    return rows.transpose(1, 2).reshape(tensor.shape).contiguous()


def _is_redundant(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model recomputes or shares."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def _first_names(names: list[str]) -> str:
    more = f" (and {len(names) - _SHOWN_NAMES} more)" if len(names) > _SHOWN_NAMES else ""
    return ", ".join(names[:_SHOWN_NAMES]) + more
