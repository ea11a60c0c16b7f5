"""Quantized weights: GGUF blocks repacked exactly (against gguf's own dequantization), the kernels
against a float reference within derived bounds, round-to-nearest quantization, and the switch."""
from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM
from pagedllm.config import EngineConfig
from pagedllm.model import linear
from pagedllm.model.kernels import kernels as compiled
from pagedllm.model.linear import ConcatLinear, Embedding, QuantizedLinear, fused_linear
from pagedllm.model.quantization import GGUF_QUANTIZED_TYPES, QuantizedWeight, from_gguf, quantize

# Byte offsets of each block type's float16 scale fields (gguf.quants' layouts): random bytes elsewhere
# are valid quants, random float16 scales would be NaN or huge.
SCALE_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_gguf_tensor(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A tensor's raw blocks as a GGUF file stores them: uint8 [rows, bytes per row]."""
    block_columns, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_columns, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[type_name]:
        scales = (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def gguf_reference(data: np.ndarray, type_name: str, rows: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(values.reshape(rows, cols))


def test_every_supported_type_is_tested():
    assert set(SCALE_OFFSETS) == GGUF_QUANTIZED_TYPES


@pytest.mark.parametrize("type_name", sorted(GGUF_QUANTIZED_TYPES))
def test_repack_is_exact_against_gguf(type_name):
    rows, cols = 48, 512
    data = random_gguf_tensor(type_name, rows, cols)
    weight = from_gguf(data, type_name, (rows, cols))
    reference = gguf_reference(data, type_name, rows, cols)
    assert weight.shape == (rows, cols)
    assert torch.equal(weight.dequantize(), reference)
    if compiled is not None:
        out = torch.empty(rows, cols)
        compiled.dequantize(out, weight.qweight, weight.scales, weight.mins, weight.bits, weight.group_size)
        assert torch.equal(out, reference)
        out = torch.empty(rows, cols, dtype=torch.bfloat16)
        compiled.dequantize(out, weight.qweight, weight.scales, weight.mins, weight.bits, weight.group_size)
        assert torch.equal(out, reference.bfloat16())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_repack_is_exact_for_weights_gguf_quantized(type_name):
    """Real weights quantized by gguf's own quantizer, not only random blocks."""
    weight = torch.randn(40, 256, generator=torch.Generator().manual_seed(1)).numpy()
    data = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[type_name])
    assert torch.equal(from_gguf(data, type_name, weight.shape).dequantize(), gguf_reference(data, type_name, 40, 256))


def test_q4_0_scales_beyond_float16_fall_back_to_float32_exactly():
    data = random_gguf_tensor("Q4_0", 2, 64)
    data[0, 0:2] = np.array([30000.0], dtype=np.float16).view(np.uint8)   # -8 d leaves float16's range
    weight = from_gguf(data, "Q4_0", (2, 64))
    assert weight.scales.dtype == torch.float32
    assert torch.equal(weight.dequantize(), gguf_reference(data, "Q4_0", 2, 64))


def dot_product_bound(x: torch.Tensor, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Worst-case error of the int8 dot-product path against x @ W^T in float, per output element.
    x is rounded per row and group to multiples of s = absmax / 127, so each element moves by at most
    s / 2, and output (m, n) by at most sum over groups of s[m, g] / 2 * sum |W[n, group g]|. Float
    accumulation adds ~K * 2^-24 relative to |x| @ |W|^T; 1e-5 of it covers that with room."""
    rows, cols = x.shape
    half_steps = x.float().abs().reshape(rows, -1, group_size).amax(-1) / 254
    weight_sums = weight.abs().reshape(weight.shape[0], -1, group_size).sum(-1)
    return half_steps @ weight_sums.T + 1e-5 * (x.float().abs() @ weight.abs().T) + 1e-6


def quantized_weights(seed: int, rows: int, cols: int) -> list[QuantizedWeight]:
    """One weight of each format: the GGUF types and int8/int4 round-to-nearest."""
    gguf_types = [name for name in sorted(GGUF_QUANTIZED_TYPES) if cols % 256 == 0 or not name.endswith("_K")]
    weights = [from_gguf(random_gguf_tensor(name, rows, cols, seed), name, (rows, cols)) for name in gguf_types]
    dense = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    return weights + [quantize(dense, 8), quantize(dense, 4)]


@pytest.mark.kernels
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 9, 16, 33, 128, 512])
@pytest.mark.parametrize("shape", [(33, 256), (96, 512), (7, 32)])
def test_quantized_linear_against_float_reference(num_rows, shape):
    """QuantizedLinear (the dot-product kernel at every row count): every format, odd row counts and output sizes
    (the last row tile padded), with and without bias."""
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=generator)
    x[0, :7] *= 20   # outliers inside a group: its activation scale grows, the bound with it
    bias = torch.randn(out_features, generator=generator)
    for weight in quantized_weights(num_rows, out_features, in_features):
        dense = weight.dequantize()
        for layer_bias in (None, bias):
            out = QuantizedLinear(weight, layer_bias)(x)
            reference = F.linear(x, dense, layer_bias)
            bound = dot_product_bound(x, dense, weight.group_size)
            assert ((out - reference).abs() <= bound).all(), (weight.source, (out - reference).abs().max())


@pytest.mark.kernels
@pytest.mark.parametrize("num_rows", [1, 6, 40, 65, 200])
def test_quantized_linear_in_bfloat16(num_rows):
    x = torch.randn(num_rows, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    for weight in quantized_weights(4, 24, 256):
        dense = weight.dequantize()
        out = QuantizedLinear(weight)(x)
        assert out.dtype == torch.bfloat16
        reference = x.float() @ dense.T
        bound = dot_product_bound(x, dense, weight.group_size) + 2 ** -8 * reference.abs()   # + output rounding
        assert ((out.float() - reference).abs() <= bound).all(), weight.source


@pytest.mark.kernels
def test_a_row_does_not_depend_on_the_batch_it_shares():
    """A request's logits must not change with the batch around it (prefill or decode, recomputed
    after preemption or not): each row's result is its own, bit for bit."""
    weight = quantize(torch.randn(40, 128), 4)
    rows = torch.randn(300, 128).bfloat16()
    layer = QuantizedLinear(weight)
    alone = torch.cat([layer(rows[i:i + 1]) for i in range(0, 300, 37)])
    assert torch.equal(layer(rows)[::37], alone)


@pytest.mark.parametrize("bits", [8, 4])
def test_round_to_nearest_error_is_at_most_half_a_step(bits):
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(bits))
    weight[3] = 0   # an all-zero group quantizes to zeros, not NaN
    quantized = quantize(weight, bits)
    assert (quantized.bits, quantized.group_size, quantized.shape) == (bits, 32, (16, 128))
    error = (quantized.dequantize() - weight).abs().reshape(16, 4, 32)
    step = quantized.group_params(quantized.scales)[:16].float().unsqueeze(-1)
    # half a step, plus what float16 rounding of the scale (and the minimum) moves the grid by
    slack = 2 ** -11 * (weight.abs().reshape(16, 4, 32).amax(-1, keepdim=True)) * (3 if bits == 4 else 1)
    assert (error <= step / 2 + slack + 1e-7).all()
    assert torch.equal(quantized.dequantize()[3], torch.zeros(128))


def test_embedding_rows_and_the_tied_head_share_the_packed_table():
    weight = from_gguf(random_gguf_tensor("Q8_0", 100, 64), "Q8_0", (100, 64))
    embedding = Embedding(weight, torch.float32)
    ids = torch.tensor([5, 0, 99, 5])
    assert torch.equal(embedding(ids), weight.dequantize()[ids])
    head = fused_linear([weight])
    assert head.qweight.data_ptr() == embedding.table.qweight.data_ptr()
    four_bit = quantize(torch.randn(37, 64), 4)   # 4-bit rows, the last tile padded
    ids = torch.tensor([36, 0, 17, 17])
    assert torch.equal(Embedding(four_bit, torch.float32)(ids), four_bit.dequantize()[ids])


def test_projections_of_different_formats_run_side_by_side():
    """Q4_K_M files mix Q4_K and Q6_K within one layer's Q/K/V: the parts stay apart, outputs joined."""
    q = from_gguf(random_gguf_tensor("Q4_K", 32, 256, 1), "Q4_K", (32, 256))
    v = from_gguf(random_gguf_tensor("Q6_K", 16, 256, 2), "Q6_K", (16, 256))
    layer = fused_linear([q, q, v])
    assert isinstance(layer, ConcatLinear) and len(layer.parts) == 2
    stacked = fused_linear([q, q])
    assert isinstance(stacked, QuantizedLinear) and stacked.out_features == 64
    x = torch.randn(3, 256)
    dense = torch.cat([q.dequantize(), q.dequantize(), v.dequantize()])
    out = layer(x)
    assert out.shape == (3, 80)
    if compiled is not None:
        assert ((out - x @ dense.T).abs() <= dot_product_bound(x, dense, 16)).all()


def test_quantization_must_be_a_known_value():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4, got 'q4'"):
        EngineConfig(quantization="q4")


@pytest.mark.parametrize("quantization, formats", [
    ("auto", {"float32"}), ("none", {"float32"}), ("int8", {"int8"}), ("int4", {"int4", "int8"})])
def test_the_switch_on_a_float_checkpoint(quantization, formats, make_tiny_model_dir, tmp_path, caplog):
    """auto and none leave float weights as they are; int8/int4 quantize every linear layer (int4 keeps
    the embedding and LM head at 8 bits) and the start-up log names the formats."""
    folder = make_tiny_model_dir(tmp_path, "qwen2")
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.llm_engine"):
        llm = LLM(str(folder), quantization=quantization, dtype="float32", kv_cache_memory="8MiB")
    model = llm.llm_engine.runner.model
    found = {module.format for module in model.modules() if isinstance(module, (linear.Linear, QuantizedLinear))}
    assert found == formats
    if quantization == "int4":
        assert model.lm_head.format == model.embed_tokens.format == "int8"
        assert model.layers[0].qkv_proj.format == "int4"
    assert f"quantization={quantization}" in caplog.text and "MiB of weights" in caplog.text


def test_the_bundled_gguf_runs_quantized_by_default():
    llm = LLM(None, kv_cache_memory="16MiB")
    model = llm.llm_engine.runner.model
    assert model.embed_tokens.format == "Q8_0" and model.layers[0].gate_up_proj.format == "Q4_1"
    assert model.weight_bytes() < 110 * 10**6
    float_llm = LLM(None, quantization="none", dtype="float32", kv_cache_memory="16MiB")
    assert float_llm.llm_engine.runner.model.weight_bytes() > 500 * 10**6
