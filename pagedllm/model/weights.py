"""Checkpoint tensors by Hugging Face parameter names, checked against a config, read lazily one at a time."""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import safetensors
import torch

from pagedllm.model.config import ModelConfig
from pagedllm.model.moe_config import gated_mlp_prefixes, is_sparse
from pagedllm.model.quantization import GGUF_QUANTIZED_TYPES, QuantizedWeight, from_gguf
from pagedllm.model.tensor_parallel import Shard

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
    "ffn_gate_inp": "mlp.gate",   # the router
    "ffn_gate_exps": "mlp.experts.gate_proj",   # every expert's weight in one 3-D tensor (_STACKED_EXPERTS)
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Per architecture, GGUF block tensors named otherwise: Phi-3's ffn_up holds gate and up rows together;
# Gemma's ffn_norm is the norm before the MLP, beside norms on the attention and MLP outputs.
_GEMMA_BLOCK_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_ARCH_BLOCK_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                          "gemma2": _GEMMA_BLOCK_NAMES, "gemma3": _GEMMA_BLOCK_NAMES}
# Hugging Face Gemma checkpoints store each RMSNorm's weight w for a scale of (1 + w); it is read as 1 + w
# (llama.cpp's converter stores it so), and the model scales by its norm weights as they are.
_HF_NORM_PLUS_ONE_ARCHITECTURES = ("gemma2", "gemma3")
# GGUF tensors that are model facts, read into the config (model_config_from_gguf), not weights.
GGUF_ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
# Checkpoint tensors that hold several of the model's weights stacked by rows (Phi-3's), in row order.
_FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# Mixtral's checkpoint names for what the model calls mlp.gate and mlp.experts.N.{gate,down,up}_proj.
_MIXTRAL_NAME = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.(w1|w2|w3))\.weight")
_MIXTRAL_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# A 3-D tensor holding one weight per expert (llama.cpp's ffn_*_exps), read as mlp.experts.N.*_proj.
_STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\w+_proj\.weight)")
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
        if config.sandwich_norms:
            shapes |= {prefix + "pre_feedforward_layernorm.weight": (hidden,),
                       prefix + "post_feedforward_layernorm.weight": (hidden,)}
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (q_size, hidden),
            prefix + "self_attn.k_proj.weight": (kv_size, hidden),
            prefix + "self_attn.v_proj.weight": (kv_size, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_size),
        }
        shapes |= _mlp_weight_shapes(config, layer, prefix + "mlp.")
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


def _mlp_weight_shapes(config: ModelConfig, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """A layer's dense MLP, or its router, experts and shared expert with its gate."""
    hidden, moe = config.hidden_size, config.moe
    if not is_sparse(moe, layer):
        sizes = {prefix: config.intermediate_size}
    else:
        sizes = {mlp: moe.moe_intermediate_size for mlp in gated_mlp_prefixes(moe, layer, prefix)}
        sizes[prefix + "shared_expert."] = moe.shared_expert_intermediate_size
    shapes = {}
    for mlp, inter in sizes.items():
        if inter:
            shapes |= {mlp + "gate_proj.weight": (inter, hidden), mlp + "up_proj.weight": (inter, hidden),
                       mlp + "down_proj.weight": (hidden, inter)}
    if is_sparse(moe, layer):
        shapes[prefix + "gate.weight"] = (moe.num_experts, hidden)
        if moe.shared_expert_intermediate_size:
            shapes[prefix + "shared_expert_gate.weight"] = (1, hidden)
    return shapes


class CheckpointWeights(Mapping):
    """A checkpoint's tensors by Hugging Face name, each read from the (memory-mapped) file only when
    asked for: the model takes them one at a time into their final form, so no whole-checkpoint copy
    is ever held. `formats` names each tensor's storage (a GGUF type such as Q4_K, or a torch dtype).
    With `shards` (a tensor-parallel rank's, tensor_parallel.py), a tensor reads as this rank's part only."""

    def __init__(self, read: Callable[[str, Shard | None], torch.Tensor | QuantizedWeight], formats: dict[str, str],
                 shards: Mapping[str, Shard] | None = None):
        self._read = read
        self.formats = formats
        self.shards = shards or {}

    def read(self, name: str, shard: Shard | None = None) -> torch.Tensor | QuantizedWeight:
        return self._read(name, shard)

    def sharded(self, shards: Mapping[str, Shard]) -> CheckpointWeights:
        return CheckpointWeights(self._read, self.formats, shards)

    def __getitem__(self, name: str) -> torch.Tensor | QuantizedWeight:
        if name not in self.formats:
            raise KeyError(name)
        return self._read(name, self.shards.get(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.formats)

    def __len__(self) -> int:
        return len(self.formats)


def check_weight_shapes(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig,
                        expected: Mapping[str, tuple[int, ...]] | None = None,
                        unused: Callable[[str], bool] = lambda name: False) -> list[str]:
    """The names of the tensors the model reads; ValueError if one is missing, mis-shaped, or a stray
    tensor would be silently ignored (e.g. a bias the config does not declare). expected: the model's own
    names and shapes (default: the decoder's); unused: names a checkpoint may carry that the model leaves."""
    expected = expected_weight_shapes(config) if expected is None else expected
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise ValueError(f"Checkpoint is missing {len(missing)} weight(s): {_first_names(missing)}")
    unexpected = [name for name in shapes
                  if name not in expected and not _is_redundant(name, config) and not unused(name)]
    if unexpected:
        raise ValueError(
            f"Checkpoint has {len(unexpected)} weight(s) the model does not use: {_first_names(unexpected)}"
        )
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"Weight {name} has shape {tuple(shapes[name])}, expected {shape}")
    return list(expected)


@dataclass(frozen=True)
class StoredRows:
    """Where a weight lies in the checkpoint: rows [start, stop) of the stored tensor `source`, which has
    source_rows rows (all of them, but for a weight stored stacked with others in one tensor)."""
    source: str
    start: int
    stop: int
    source_rows: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.source_rows


def locate_weights(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig,
                   expected: Mapping[str, tuple[int, ...]] | None = None
                   ) -> tuple[dict[str, tuple[int, ...]], dict[str, StoredRows]]:
    """The checkpoint's tensors as the model's weights: fused tensors (Phi-3's qkv_proj, gate_up_proj)
    split into their parts by rows, stacked experts into each expert's weight, Mixtral's names as the
    model's. Returns each weight's shape and where it is stored."""
    expected = expected_weight_shapes(config) if expected is None else expected
    weight_shapes, stored = {}, {}
    for name, shape in shapes.items():
        if stacked := _STACKED_EXPERTS.fullmatch(name):
            if len(shape) != 3:
                raise ValueError(f"Weight {name} has shape {shape}, expected [experts, rows, columns]")
            for expert in range(shape[0]):
                part = f"{stacked.group(1)}{expert}.{stacked.group(2)}"
                weight_shapes[part] = shape[1:]
                stored[part] = StoredRows(name, expert * shape[1], (expert + 1) * shape[1], shape[0] * shape[1])
            continue
        if mixtral := _MIXTRAL_NAME.fullmatch(name):
            layer, part, proj = mixtral.groups()
            part = part.replace(proj, _MIXTRAL_EXPERT_PROJ[proj]) if proj else part
            weight_shapes[f"{layer}mlp.{part}.weight"] = shape
            stored[f"{layer}mlp.{part}.weight"] = StoredRows(name, 0, shape[0], shape[0])
            continue
        stem, _, kind = name.rpartition(".")
        fused = next((fused for fused in _FUSED_PARTS if stem.endswith("." + fused)), None)
        if fused is None:
            weight_shapes[name] = shape
            stored[name] = StoredRows(name, 0, shape[0] if shape else 0, shape[0] if shape else 0)
            continue
        start = 0
        for member in _FUSED_PARTS[fused]:
            part = f"{stem.removesuffix(fused)}{member}.{kind}"
            if part not in expected:
                raise ValueError(f"Checkpoint has weight {name}, whose part {part} the model does not use")
            rows = expected[part][0]
            weight_shapes[part] = (rows, *shape[1:])
            stored[part] = StoredRows(name, start, start + rows, shape[0])
            start += rows
        if start != shape[0]:
            raise ValueError(f"Weight {name} has {shape[0]} rows, expected {start} "
                             f"({' + '.join(_FUSED_PARTS[fused])})")
    return weight_shapes, stored


def load_safetensors_weights(folder: Path, config: ModelConfig,
                             expected: Mapping[str, tuple[int, ...]] | None = None,
                             unused: Callable[[str], bool] = lambda name: False) -> CheckpointWeights:
    """model.safetensors, or every shard model.safetensors.index.json names, in their stored dtypes;
    expected and unused as check_weight_shapes takes them."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    handles, shapes, formats = {}, {}, {}
    for file in files:
        try:
            handle = safetensors.safe_open(folder / file, framework="pt")
            for name in handle.keys():
                part = handle.get_slice(name)
                handles[name], shapes[name], formats[name] = handle, tuple(part.get_shape()), part.get_dtype()
        except safetensors.SafetensorError as exc:
            raise ValueError(f"{folder / file} is not a readable safetensors file: {exc}") from exc
    weight_shapes, stored = locate_weights(shapes, config, expected)
    names = check_weight_shapes(weight_shapes, config, expected, unused)
    norms_plus_one = config.architecture in _HF_NORM_PLUS_ONE_ARCHITECTURES

    def read(name: str, shard: Shard | None) -> torch.Tensor:
        weight = read_stored(name, shard)
        return weight.float() + 1 if norms_plus_one and name.endswith("norm.weight") else weight

    def read_stored(name: str, shard: Shard | None) -> torch.Tensor:
        rows = stored[name]
        if shard is None and rows.whole:
            return handles[rows.source].get_tensor(rows.source)
        part = handles[rows.source].get_slice(rows.source)   # reads this part of the file only
        if shard is None:
            return part[rows.start:rows.stop]
        start, stop = shard.bounds(weight_shapes[name][shard.dim])
        if shard.dim == 0:
            return part[rows.start + start:rows.start + stop]
        return part[rows.start:rows.stop, start:stop]

    return CheckpointWeights(read, {name: formats[stored[name].source] for name in names})


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file; the reader's low-level failures on damaged files become a ValueError naming it."""
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc


def read_gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """GGUF key/values as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def load_gguf_weights(reader: gguf.GGUFReader, config: ModelConfig, keep_quantized: bool = False
                      ) -> CheckpointWeights:
    """A GGUF's tensors under their HF names and shapes, with llama.cpp's q/k row permutation undone.
    keep_quantized: 2-D tensors of a type with an exact internal format (quantization.py) come as
    QuantizedWeight; everything else is dequantized to float32."""
    tensors = {_hf_name(tensor.name, config.architecture): tensor for tensor in reader.tensors
               if tensor.name not in GGUF_ROPE_FACTOR_TENSORS}
    raw_shapes = {name: tuple(int(dim) for dim in reversed(tensor.shape)) for name, tensor in tensors.items()}
    for name, shape in raw_shapes.items():
        if name.endswith(".shared_expert_gate.weight") and len(shape) == 1:
            raw_shapes[name] = (1, *shape)   # quantized files store Qwen2-MoE's [1, hidden] as [hidden]
    shapes, stored = locate_weights(raw_shapes, config)
    names = check_weight_shapes(shapes, config)
    row_orders = {}
    if config.architecture == "llama":
        row_orders = {name: _rotary_row_order(shapes[name][0], config.num_attention_heads
                                              if ".self_attn.q_proj." in name else config.num_key_value_heads)
                      for name in names if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name}

    def read(name: str, shard: Shard | None) -> torch.Tensor | QuantizedWeight:
        try:
            return read_tensor(name, shard)
        finally:
            _drop_mapped_pages(reader, tensors[stored[name].source])

    def read_tensor(name: str, shard: Shard | None) -> torch.Tensor | QuantizedWeight:
        rows = stored[name]
        tensor = tensors[rows.source]
        # This weight's rows of the stored blocks (an expert's of a stacked tensor): only they are converted.
        blocks = tensor.data.reshape(rows.source_rows, -1)[rows.start:rows.stop]
        if keep_quantized and tensor.tensor_type.name in GGUF_QUANTIZED_TYPES and len(shapes[name]) == 2:
            return from_gguf(blocks, tensor.tensor_type.name, shapes[name], row_orders.get(name), shard)
        try:
            values = gguf.quants.dequantize(blocks, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(f"GGUF tensor {tensor.name}: {exc}") from exc
        if not values.flags.writeable:
            # F32 tensors come back as read-only views of the memory-mapped file; tensors must own memory.
            values = values.copy()
        weight = torch.from_numpy(values.reshape(shapes[name]))
        weight = weight[row_orders[name]] if name in row_orders else weight
        return weight if shard is None else shard.of(weight)

    return CheckpointWeights(read, {name: tensors[stored[name].source].tensor_type.name for name in names})


def read_gguf_rope_factors(reader: gguf.GGUFReader) -> dict[str, list[float]]:
    """A longrope model's long and short factors, which llama.cpp stores as tensors ({} if none)."""
    return {GGUF_ROPE_FACTOR_TENSORS[tensor.name]: [float(x) for x in np.asarray(tensor.data).reshape(-1)]
            for tensor in reader.tensors if tensor.name in GGUF_ROPE_FACTOR_TENSORS}


def _drop_mapped_pages(reader: gguf.GGUFReader, tensor) -> None:
    """Tells the OS this process is done with a tensor's pages of the memory-mapped file (its values
    were copied into their final form): they leave the process's resident memory and stay in the
    page cache, so reading a file of N GB never holds N GB resident on top of the weights."""
    mapping = getattr(reader.data, "_mmap", None)   # numpy.memmap's mmap object
    if mapping is None:
        return
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)


def _hf_name(gguf_name: str, architecture: str) -> str:
    if block := _GGUF_BLOCK_TENSOR.fullmatch(gguf_name):
        layer, part, kind = block.groups()
        names = _GGUF_BLOCK_NAMES | _GGUF_ARCH_BLOCK_NAMES.get(architecture, {})
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    elif (single := _GGUF_GLOBAL_TENSOR.fullmatch(gguf_name)) and single.group(1) in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[single.group(1)]}.{single.group(2)}"
    raise ValueError(f"Unknown GGUF tensor {gguf_name!r}")


def _rotary_row_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from HF's half-split rotary layout to
    interleaved pairs (rows viewed as [head, 2, half] become [head, half, 2]): the row indices that
    put them back."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def _is_redundant(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model recomputes or shares."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def _first_names(names: list[str]) -> str:
    more = f" (and {len(names) - _SHOWN_NAMES} more)" if len(names) > _SHOWN_NAMES else ""
    return ", ".join(names[:_SHOWN_NAMES]) + more
