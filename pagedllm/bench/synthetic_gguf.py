"""A synthetic Llama GGUF of any size, written with `gguf`'s own writer, so that loading a 1B-parameter
quantized model can be measured with nothing downloaded.

The weights are random quantized blocks. Random bytes make valid blocks of every type once their
float16 scale fields hold small values, chosen here so each weight type has a standard deviation near
0.02 (a trained model's order) and activations stay finite through any number of layers. The
tokenizer, chat template included, is copied from the bundled model, so the vocabulary is its size.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import astuple, dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from pagedllm.model.loader import bundled_model_path

# Per block type: (byte offset of a float16 scale field in the block, low, high) for each such field.
# With scales drawn uniformly in [low, high], random blocks dequantize to weights of standard deviation
# ~0.02; Q4_K's dmin (the second field) roughly cancels the mean its unsigned quants would otherwise have.
_SCALE_FIELDS: dict[GGMLType, tuple[tuple[int, float, float], ...]] = {
    GGMLType.Q4_0: ((0, 2e-3, 6e-3),),
    GGMLType.Q8_0: ((0, 1e-4, 4e-4),),
    GGMLType.Q4_K: ((0, 5e-5, 1e-4), (2, 4e-4, 7e-4)),
    GGMLType.Q6_K: ((208, 7e-6, 2e-5),),
}
SYNTHETIC_TYPES = tuple(_SCALE_FIELDS)


@dataclass(frozen=True)
class SyntheticLlama:
    """The shape and weight types of a synthetic model; the defaults make a ~1.07B-parameter Llama
    (TinyLlama's shape with the bundled tokenizer's 49152-token vocabulary, embeddings tied)."""
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_layers: int = 22
    num_heads: int = 32
    num_kv_heads: int = 4
    context_length: int = 2048
    embedding_type: GGMLType = GGMLType.Q8_0
    weight_type: GGMLType = GGMLType.Q4_0
    ffn_down_type: GGMLType = GGMLType.Q4_K

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def tensors(self, vocab_size: int) -> list[tuple[str, tuple[int, ...], GGMLType]]:
        """(llama.cpp name, shape as rows x columns like PyTorch's, type) of every tensor, in file order."""
        hidden, kv_size = self.hidden_size, self.num_kv_heads * self.head_dim
        per_layer = [
            ("attn_norm", (hidden,), GGMLType.F32),
            ("attn_q", (hidden, hidden), self.weight_type),
            ("attn_k", (kv_size, hidden), self.weight_type),
            ("attn_v", (kv_size, hidden), self.weight_type),
            ("attn_output", (hidden, hidden), self.weight_type),
            ("ffn_norm", (hidden,), GGMLType.F32),
            ("ffn_gate", (self.intermediate_size, hidden), self.weight_type),
            ("ffn_up", (self.intermediate_size, hidden), self.weight_type),
            ("ffn_down", (hidden, self.intermediate_size), self.ffn_down_type),
        ]
        return [("token_embd.weight", (vocab_size, hidden), self.embedding_type),
                *((f"blk.{layer}.{part}.weight", shape, kind)
                  for layer in range(self.num_layers) for part, shape, kind in per_layer),
                ("output_norm.weight", (hidden,), GGMLType.F32)]


def synthetic_cache_path(spec: SyntheticLlama) -> Path:
    """Where the bench keeps a synthetic file: beside the tokenizer cache ($PAGEDLLM_CACHE_DIR, else
    ~/.cache/pagedllm), named by a digest of the spec so a changed spec never reuses a stale file."""
    from pagedllm.tokenizer import tokenizer_cache_dir

    digest = hashlib.sha256(repr(astuple(spec)).encode()).hexdigest()[:12]
    return tokenizer_cache_dir().parent / f"synthetic-llama-{digest}.gguf"


def ensure_synthetic_gguf(path: Path, spec: SyntheticLlama) -> Path:
    """The file at path, written first if it is not there yet (a 1B file takes a minute to write)."""
    if not path.is_file():
        write_synthetic_gguf(path, spec)
    return path


def write_synthetic_gguf(path: Path, spec: SyntheticLlama, seed: int = 0) -> Path:
    """Writes the model tensor by tensor (the writer's streaming API), so memory holds one tensor at a
    time, not the model; through a temporary name renamed at the end, so a killed run leaves no
    half-written file for ensure_synthetic_gguf to reuse."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bundled = gguf.GGUFReader(bundled_model_path())
    vocab_size = len(bundled.fields["tokenizer.ggml.tokens"].contents())
    tensors = spec.tensors(vocab_size)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, "llama")
    try:
        _add_model_metadata(writer, spec, vocab_size)
        _copy_tokenizer_metadata(writer, bundled)
        for name, shape, kind in tensors:
            byte_shape = _byte_shape(shape, kind)
            dtype = np.float32 if kind == GGMLType.F32 else np.uint8
            nbytes = int(np.prod(byte_shape)) * np.dtype(dtype).itemsize
            writer.add_tensor_info(name, byte_shape, np.dtype(dtype), nbytes, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for _, shape, kind in tensors:
            writer.write_tensor_data(_random_tensor(shape, kind, rng))
    finally:
        writer.close()
    partial.replace(path)
    return path


def _add_model_metadata(writer: gguf.GGUFWriter, spec: SyntheticLlama, vocab_size: int) -> None:
    """The llama.* keys pagedllm's loader (model_config_from_gguf) and transformers' GGUF reader use."""
    writer.add_name("synthetic-llama")
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _copy_tokenizer_metadata(writer: gguf.GGUFWriter, reader: gguf.GGUFReader) -> None:
    """Every tokenizer.* key (vocabulary, merges, special ids, chat template) with its stored type."""
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)


def _byte_shape(shape: tuple[int, ...], kind: GGMLType) -> tuple[int, ...]:
    """The array shape the writer takes for a tensor: elements for F32, bytes per row for block types
    (the writer turns those back into element counts; the row must hold whole blocks)."""
    if kind == GGMLType.F32:
        return shape
    return gguf.quant_shape_to_byte_shape(shape, kind)


def _random_tensor(shape: tuple[int, ...], kind: GGMLType, rng: np.random.Generator) -> np.ndarray:
    """Norm weights are ones (as a trained model's are, roughly); block types get random bytes with
    sane scales."""
    if kind == GGMLType.F32:
        return np.ones(shape, dtype=np.float32)
    byte_shape = _byte_shape(shape, kind)
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    blocks = np.frombuffer(bytearray(rng.bytes(int(np.prod(byte_shape)))), dtype=np.uint8)
    blocks = blocks.reshape(-1, block_bytes)
    for offset, low, high in _SCALE_FIELDS[kind]:
        scales = rng.uniform(low, high, len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(byte_shape)
