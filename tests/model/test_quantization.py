"""Quantized weights: GGUF blocks repacked exactly (against gguf's own dequantization), the kernels
against a float reference within derived bounds, round-to-nearest quantization, and the switch."""
from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import parse_args
from pagedllm.model import linear
from pagedllm.model.kernels import kernels as compiled
from pagedllm.model.linear import ConcatLinear, Embedding, QuantizedLinear, fused_linear
from pagedllm.model.quantization import GGUF_QUANTIZED_TYPES, QuantizedWeight, from_gguf, quantize
from pagedllm.model.quantized_matmul import (BRGEMM_FROM_ROWS, FORCE_VARIABLE, INT8_TILES_FROM_ROWS,
                                             QuantizedMatmul, brgemm_isa, int16_is_faster)

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


def dot_product_bound(x: torch.Tensor, weight: torch.Tensor, group_size: int, levels: int = 127) -> torch.Tensor:
    """Worst-case error of an integer dot-product path (int8: levels 127; int16: 32767) against x @ W^T in float,
    per output element. x is rounded per row and group to multiples of s = absmax / levels, so each element moves
    by at most s / 2, and output (m, n) by at most sum over groups of s[m, g] / 2 * sum |W[n, group g]|. Float
    accumulation adds ~K * 2^-24 relative to |x| @ |W|^T; 1e-5 of it covers that with room."""
    rows, cols = x.shape
    half_steps = x.float().abs().reshape(rows, -1, group_size).amax(-1) / (2 * levels)
    weight_sums = weight.abs().reshape(weight.shape[0], -1, group_size).sum(-1)
    return half_steps @ weight_sums.T + 1e-5 * (x.float().abs() @ weight.abs().T) + 1e-6


FLOAT32_UNIT = 2.0 ** -24    # float32's unit roundoff
BFLOAT16_UNIT = 2.0 ** -8    # bfloat16's (8 significant bits)


def gamma(terms: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n float32 roundings."""
    return terms * FLOAT32_UNIT / (1 - terms * FLOAT32_UNIT)


def scaled_terms(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """T = sum over groups g of |scale_g| sum_c |q_c| |x_c| + |min_g| sum_c |x_c|, plus |bias|: the magnitudes the
    rows kernel adds (it sums q x per group and scales once, so scale q x and min x can cancel; the bound must be
    on their magnitudes, not on |x| @ |W|^T)."""
    rows, cols = weight.shape
    groups = cols // weight.group_size
    q = weight.values()[:rows].float().abs().view(rows, groups, weight.group_size)
    scales = weight.group_params(weight.scales)[:rows].float().abs()
    x_abs = x.float().abs()
    total = x_abs @ (q * scales.unsqueeze(-1)).view(rows, cols).T
    if weight.mins is not None:
        group_sums = x_abs.view(x.shape[0], groups, weight.group_size).sum(-1)
        total = total + group_sums @ weight.group_params(weight.mins)[:rows].float().abs().T
    return total + (bias.float().abs() if bias is not None else 0)


def path_bound(path: str, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Worst-case error of a path against F.linear(x, W, bias) in float32 (W = weight.dequantize(), each value
    rounded from scale * q + min by up to two float32 roundings), per output element. With S = |x| @ |W|^T +
    |bias|, the reference's sum of K + 1 terms errs by at most gamma(K + 1) S (recursive summation, any order).
    rows: llama.cpp's order, out = sum over groups of scale * sum(q x) + min * sum(x), + bias; each term passes
    at most group + groups + 3 roundings (its group's sum, scale and min folded in, the sum over the groups, the
    bias), so the kernel errs from the exact scale * q + min by gamma(group + groups + 3) T (scaled_terms), and
    W from it by 3 u T more. brgemm in float32 sums W's products as the reference does: gamma(K + 1) S; in bfloat16
    it multiplies W rounded to bfloat16: + u_bf16 |x| @ |W|^T. int8 and int16 activations: the float sums plus
    dot_product_bound. A bfloat16 output (out_dtype, x's if None) rounds the result once: + u_bf16 |result|."""
    dense = weight.dequantize()
    cols, group_size = x.shape[1], weight.group_size
    products = x.float().abs() @ dense.abs().T
    total = products + (bias.float().abs() if bias is not None else 0)
    reference = gamma(cols + 1) * total
    if path == "rows":
        bound = reference + gamma(group_size + cols // group_size + 3 + 3) * scaled_terms(x, weight, bias)
    else:
        bound = 2 * reference
    if path.startswith("int8") or path == "int16":
        bound = bound + dot_product_bound(x, dense, group_size, 127 if path.startswith("int8") else 32767)
    if path == "brgemm" and x.dtype == torch.bfloat16:
        bound = bound + BFLOAT16_UNIT * products
    if (out_dtype or x.dtype) == torch.bfloat16:
        exact = F.linear(x.float(), dense, None if bias is None else bias.float()).abs()
        bound = bound + BFLOAT16_UNIT * (exact + bound)
    return bound


def quantized_weights(seed: int, rows: int, cols: int) -> list[QuantizedWeight]:
    """One weight of each format: the GGUF types and int8/int4 round-to-nearest."""
    gguf_types = [name for name in sorted(GGUF_QUANTIZED_TYPES) if cols % 256 == 0 or not name.endswith("_K")]
    weights = [from_gguf(random_gguf_tensor(name, rows, cols, seed), name, (rows, cols)) for name in gguf_types]
    dense = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    return weights + [quantize(dense, 8), quantize(dense, 4)]


def runnable_paths(dtype: torch.dtype) -> list[str]:
    """The compiled matmul paths this machine runs for activations of dtype."""
    if compiled is None:
        return []
    return ["rows", "int8", "int8_tiles", "int16"] + (["brgemm"] if brgemm_isa(dtype) is not None else [])


def forced(path: str, monkeypatch) -> QuantizedMatmul:
    monkeypatch.setenv(FORCE_VARIABLE, path)
    return QuantizedMatmul()


ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 33, 63, 64, 65, 128, 200, 511, 512]


@pytest.mark.kernels
@pytest.mark.parametrize("num_rows", ROW_COUNTS)
@pytest.mark.parametrize("shape", [(33, 256), (96, 512), (7, 32)])
def test_quantized_linear_against_float_reference(num_rows, shape, monkeypatch):
    """Every compiled path in float32, every format, odd row counts and output sizes (the last row tile
    padded), with and without bias, against the float reference within the path's derived bound."""
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=generator)
    x[0, :7] *= 20   # outliers inside a group: the int8 path's activation scale grows, its bound with it
    bias = torch.randn(out_features, generator=generator)
    weights = quantized_weights(num_rows, out_features, in_features)
    for path in runnable_paths(torch.float32):
        matmul = forced(path, monkeypatch)
        for weight in weights:
            dense = weight.dequantize()
            for layer_bias in (None, bias):
                out = QuantizedLinear(weight, layer_bias, matmul)(x)
                error = (out - F.linear(x, dense, layer_bias)).abs()
                assert (error <= path_bound(path, x, weight, layer_bias)).all(), (
                    path, weight.source, error.max())


@pytest.mark.kernels
@pytest.mark.parametrize("num_rows", [1, 5, 6, 8, 9, 17, 40, 64, 65, 200, 511])
def test_quantized_linear_in_bfloat16(num_rows, monkeypatch):
    x = torch.randn(num_rows, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(40, generator=torch.Generator().manual_seed(4)).bfloat16()
    for path in runnable_paths(torch.bfloat16):
        matmul = forced(path, monkeypatch)
        for weight in quantized_weights(4, 40, 256):
            dense = weight.dequantize()
            out = QuantizedLinear(weight, bias, matmul)(x)
            assert out.dtype == torch.bfloat16
            error = (out.float() - F.linear(x.float(), dense, bias.float())).abs()
            assert (error <= path_bound(path, x, weight, bias)).all(), (path, weight.source)


@pytest.mark.kernels
@pytest.mark.parametrize("num_rows", [1, 5, 17, 64, 65, 200, 512])
@pytest.mark.parametrize("shape", [(33, 256), (96, 512), (7, 32)])
def test_float_sums_of_bfloat16_activations_against_float_reference(num_rows, shape, monkeypatch):
    """The LM head's layer (out_dtype float32) in a bfloat16 model: brgemm takes the bfloat16 activations as they
    are and returns its float32 sums, so only the weights' rounding to bfloat16 is added to float32's error (the
    bfloat16 brgemm bound without the output's rounding), every format, odd shapes, with and without bias."""
    if brgemm_isa(torch.bfloat16) is None:
        pytest.skip("oneDNN's brgemm does not run bfloat16 on this CPU")
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    matmul = forced("brgemm", monkeypatch)
    assert matmul.float_sums_kernel(torch.bfloat16, num_rows) == (compiled.quantized_linear_brgemm, torch.bfloat16)
    for weight in quantized_weights(num_rows, out_features, in_features):
        dense = weight.dequantize()
        for layer_bias in (None, bias):
            out = QuantizedLinear(weight, layer_bias, matmul, out_dtype=torch.float32)(x)
            assert out.dtype == torch.float32
            error = (out - F.linear(x.float(), dense, layer_bias)).abs()
            bound = path_bound("brgemm", x, weight, layer_bias, out_dtype=torch.float32)
            assert (error <= bound).all(), (weight.source, error.max())
            assert not torch.equal(out, out.bfloat16().float())   # the sums themselves, not rounded to bfloat16


@pytest.mark.kernels
def test_float_sums_take_bfloat16_into_brgemm_only_where_float32_takes_brgemm(monkeypatch):
    """The LM head's route is float32's: below its brgemm row count the rows kernel on activations widened to
    float32 (exactly), from it brgemm on the bfloat16 activations as they are; float32 activations stay float32,
    and batch invariance keeps the rows kernel in float32 at every row count."""
    if brgemm_isa(torch.bfloat16) is None:
        pytest.skip("oneDNN's brgemm does not run bfloat16 on this CPU")
    monkeypatch.delenv(FORCE_VARIABLE, raising=False)
    matmul = QuantizedMatmul()
    first = matmul.routes[torch.float32].many_from
    rows, brgemm = compiled.quantized_linear_rows, compiled.quantized_linear_brgemm
    assert matmul.float_sums_kernel(torch.bfloat16, first - 1) == (rows, torch.float32)
    assert matmul.float_sums_kernel(torch.bfloat16, first) == (brgemm, torch.bfloat16)
    assert matmul.float_sums_kernel(torch.float32, 512) == (brgemm, torch.float32)
    assert QuantizedMatmul(batch_invariant=True).float_sums_kernel(torch.bfloat16, 512) == (rows, torch.float32)
    assert "into float32 sums (LM head)" in matmul.describe(torch.bfloat16)


def test_quantized_linear_refuses_other_output_dtypes():
    with pytest.raises(ValueError, match="out_dtype must be None .* or torch.float32, got torch.float16"):
        QuantizedLinear(quantize(torch.randn(16, 32), 8), out_dtype=torch.float16)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_brgemm_past_the_cache_equals_it_in_cache_sized_calls(dtype, monkeypatch):
    """Past the activation rows that stay in cache (512 KiB: 64 rows of 2,048 float32 columns, 128 in bfloat16)
    brgemm dequantizes the whole weight first and walks the rows in chunks; its brgemm calls are the 64-row ones
    of a pass over all rows, so the result is bitwise that of calls small enough to take the in-cache order."""
    if brgemm_isa(dtype) is None:
        pytest.skip(f"oneDNN's brgemm does not run {dtype} on this CPU")
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(600, 2048, generator=generator).to(dtype)
    bias = torch.randn(72, generator=generator).to(dtype)
    layer = QuantizedLinear(quantize(torch.randn(72, 2048, generator=generator), 4), bias, forced("brgemm", monkeypatch))
    in_cache_sized = torch.cat([layer(x[start:start + 64]) for start in range(0, 600, 64)])
    assert torch.equal(layer(x), in_cache_sized)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation_dtype", ["auto", "model", "int16", "int8"])
def test_batch_invariant_rows_do_not_depend_on_the_batch_they_share(dtype, activation_dtype):
    """With batch_invariant=True a request's logits cannot change with the batch around it (prefill or
    decode, recomputed after preemption or not): each row's result is its own, bit for bit, at every row count."""
    weight = quantize(torch.randn(40, 128), 4)
    rows = torch.randn(300, 128).to(dtype)
    layer = QuantizedLinear(weight, matmul=QuantizedMatmul(activation_dtype, batch_invariant=True))
    alone = torch.cat([layer(rows[i:i + 1]) for i in range(0, 300, 37)])
    for count in (300, 64, 9, 5):
        assert torch.equal(layer(rows[:count])[::37], alone[:len(range(0, count, 37))])


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int16_rows_have_their_bits_alone_in_every_pass_size(dtype, monkeypatch):
    """int16 sums each row's products in integers and folds them per group in one order, whichever pass of the
    few-row body a row falls in (up to 5 rows a pass on AVX2, 8 with VNNI, split evenly: 6 = 3 + 3, 9 = 5 + 4,
    16 = 4 x 4) or the panels past 16 rows. So every row of a call has the bits it has alone: the rows of a
    speculative verification are the rows its tokens would have as decodes."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(24, 256, generator=generator).to(dtype)
    bias = torch.randn(33, generator=generator).to(dtype)
    matmul = forced("int16", monkeypatch)
    for weight in quantized_weights(5, 33, 256):
        layer = QuantizedLinear(weight, bias, matmul)
        alone = torch.cat([layer(x[row:row + 1]) for row in range(len(x))])
        for count in (2, 4, 5, 6, 8, 9, 10, 16, 17, 24):
            assert torch.equal(layer(x[:count]), alone[:count]), (weight.source, count)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(33, 256), (96, 512), (7, 32)])
def test_int8_tiles_gives_the_int8_kernels_bits(dtype, shape):
    """The many-row int8 kernel sums each group in integers and folds it into floats in the int8 kernel's order
    (8-bit weights offset by 128 and corrected in the integer sum), so below and past the crossover, at row counts
    off its 6-row blocks and tile counts off its 2-tile panels, every format, with and without bias, its outputs
    are the int8 kernel's bit for bit: the int8 mode stays batch invariant across the switch. (Builds without
    VNNI run the int8 kernel for both.)"""
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(out_features)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    for num_rows in (1, 5, 6, 7, INT8_TILES_FROM_ROWS, 33, 200):
        x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
        x[0, :7] *= 20
        for weight in quantized_weights(num_rows, out_features, in_features):
            for layer_bias in (None, bias):
                outs = []
                for kernel in (compiled.quantized_linear_int8, compiled.quantized_linear_int8_tiles):
                    out = torch.empty(num_rows, out_features, dtype=dtype)
                    kernel(out, x, weight.qweight, weight.scales, weight.mins, layer_bias, weight.bits, weight.group_size)
                    outs.append(out)
                assert torch.equal(*outs), (num_rows, weight.source, layer_bias is None)


@pytest.mark.kernels
def test_quantized_activations_past_the_kept_storage_equal_smaller_calls(monkeypatch):
    """The quantized activations live in storage the calling thread keeps, up to 8 MiB; past it (4,100 rows of
    2,048 columns: 8.4 MB of int8 values, 16.8 MB of int16) a call quantizes into storage of its own. Each row's
    result is its own, so the large call equals the same rows in calls that fit, on both int8 kernels and int16."""
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(4100, 2048, generator=generator)
    weight = quantize(torch.randn(40, 2048, generator=generator), 4)
    for path in ("int8", "int8_tiles", "int16"):
        layer = QuantizedLinear(weight, None, forced(path, monkeypatch))
        assert torch.equal(layer(x), torch.cat([layer(x[start:start + 512]) for start in range(0, 4100, 512)]))


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


@pytest.mark.parametrize("type_name", sorted(GGUF_QUANTIZED_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_match_gguf_dequantization_at_every_row_of_a_tile(type_name, dtype):
    """Each looked-up row is the row gguf's own dequantization gives (rounded to dtype once), whichever of its
    tile's 16 rows it is, in any order, repeated, the last tile padded (37 rows): the layer's (the compiled
    dequantize where built) and the torch formula it falls back to elsewhere."""
    rows, cols = 37, 256
    data = random_gguf_tensor(type_name, rows, cols, seed=3)
    ids = torch.cat([torch.arange(rows).flip(0), torch.tensor([16, 16, 0, 36])])
    weight = from_gguf(data, type_name, (rows, cols))
    expected = gguf_reference(data, type_name, rows, cols)[ids].to(dtype)
    for looked_up in (Embedding(weight, dtype)(ids), weight.dequantize_rows(ids, dtype)):
        assert looked_up.dtype == dtype
        assert torch.equal(looked_up, expected)


@pytest.mark.skipif(compiled is None, reason="the C++ kernels are not built")
def test_dequantize_of_rows_refuses_ids_outside_the_table():
    weight = quantize(torch.randn(37, 64), 4)
    out = torch.empty(1, 64)
    for bad in (37 + 11, -1):   # past the padded last tile's rows too (48)
        with pytest.raises(RuntimeError, match=f"dequantize: row {bad} is outside 0..47"):
            compiled.dequantize(out, weight.qweight, weight.scales, weight.mins, 4, 32, torch.tensor([bad]))
    with pytest.raises(RuntimeError, match="rows must be contiguous int64"):
        compiled.dequantize(out, weight.qweight, weight.scales, weight.mins, 4, 32, torch.tensor([1], dtype=torch.int32))
    empty = torch.empty(0, 64)
    compiled.dequantize(empty, weight.qweight, weight.scales, weight.mins, 4, 32, torch.empty(0, dtype=torch.int64))


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
    bound = torch.cat([path_bound("rows", x, part, None) for part in (q, q, v)], dim=1)
    assert ((out - x @ dense.T).abs() <= bound).all()


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
    assert model.embed_tokens.format == "Q8_0" and model.layers[0].mlp.gate_up_proj.format == "Q4_1"
    assert model.weight_bytes() < 110 * 10**6
    float_llm = LLM(None, quantization="none", dtype="float32", kv_cache_memory="16MiB")
    assert float_llm.llm_engine.runner.model.weight_bytes() > 500 * 10**6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_path_is_chosen_once_per_dtype_and_row_count(dtype, monkeypatch):
    """Default: the rows kernel below brgemm's crossover row count, brgemm from it (where oneDNN runs it for
    dtype), or on AVX2 and AVX-512 VNNI builds in float32 int16 for every row count; activation_dtype model: brgemm
    (or the rows kernel) everywhere; int16: int16 for every row count on every CPU; batch_invariant: the rows kernel
    at every row count (int16 where int16 is the default, and with activation_dtype int16); activation_dtype int8:
    the int8 kernel."""
    monkeypatch.delenv(FORCE_VARIABLE, raising=False)
    matmul, isa = QuantizedMatmul(), brgemm_isa(dtype)
    if compiled is None:
        assert matmul.kernel(dtype, 1) is matmul.kernel(dtype, 4096) is None
        return
    int16 = (QuantizedMatmul("int16"), QuantizedMatmul("int16", batch_invariant=True))
    if int16_is_faster(dtype):
        int16 += (matmul, QuantizedMatmul(batch_invariant=True))
    else:
        assert matmul.routes[dtype] == QuantizedMatmul("model").routes[dtype]
    for chosen in int16:
        assert chosen.kernel(dtype, 1) is chosen.kernel(dtype, 4096) is compiled.quantized_linear_int16
        assert chosen.describe(dtype) == "int16 for every row count"
    matmul = QuantizedMatmul("model")
    if isa is None:
        assert matmul.kernel(dtype, 1) is matmul.kernel(dtype, 4096) is compiled.quantized_linear_rows
    else:
        crossover = BRGEMM_FROM_ROWS[dtype, isa]
        assert matmul.kernel(dtype, crossover - 1) is compiled.quantized_linear_rows
        assert matmul.kernel(dtype, crossover) is matmul.kernel(dtype, 4096) is compiled.quantized_linear_brgemm
        assert matmul.describe(dtype).startswith(f"rows below {crossover} rows, brgemm (oneDNN {isa}) from {crossover}")
    if not int16_is_faster(dtype):
        invariant = QuantizedMatmul(batch_invariant=True)
        assert invariant.kernel(dtype, 1) is invariant.kernel(dtype, 4096) is compiled.quantized_linear_rows
    for int8 in (QuantizedMatmul("int8"), QuantizedMatmul("int8", batch_invariant=True)):   # the same bits per row
        assert int8.kernel(dtype, 1) is int8.kernel(dtype, INT8_TILES_FROM_ROWS - 1) is compiled.quantized_linear_int8
        assert int8.kernel(dtype, INT8_TILES_FROM_ROWS) is int8.kernel(dtype, 4096) is compiled.quantized_linear_int8_tiles
        assert int8.describe(dtype) == (f"int8 below {INT8_TILES_FROM_ROWS} rows, int8_tiles from {INT8_TILES_FROM_ROWS}")


def test_forcing_a_path(monkeypatch):
    monkeypatch.setenv(FORCE_VARIABLE, "tiles")
    with pytest.raises(ValueError, match="PAGEDLLM_MATMUL_PATH must be one of rows, brgemm, int8, int8_tiles, int16, torch, "
                                         "got 'tiles'"):
        QuantizedMatmul()
    monkeypatch.setenv(FORCE_VARIABLE, "torch")
    assert QuantizedMatmul().kernel(torch.float32, 1) is None   # dequantized per call, F.linear
    x, weight = torch.randn(3, 64), quantize(torch.randn(16, 64), 8)
    assert torch.allclose(QuantizedLinear(weight, matmul=QuantizedMatmul())(x), x @ weight.dequantize().T)


def test_activation_dtype_and_batch_invariant_are_checked(make_tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="activation_dtype must be one of auto, model, int16, int8, got 'fp8'"):
        EngineConfig(activation_dtype="fp8")
    with pytest.raises(ValueError, match="activation_dtype must be one of auto, model, int16, int8, got 'int4'"):
        QuantizedMatmul("int4")
    for activation_dtype in ("int16", "int8"):
        with pytest.raises(ValueError, match=f"activation_dtype '{activation_dtype}' multiplies quantized weights, and "
                                             "quantization 'none' leaves none"):
            EngineConfig(activation_dtype=activation_dtype, quantization="none")
    with pytest.raises(ValueError, match="batch_invariant must be True or False, got 'yes'"):
        EngineConfig(batch_invariant="yes")
    folder = str(make_tiny_model_dir(tmp_path, "llama"))
    with pytest.raises(ValueError, match="activation_dtype 'int8' multiplies quantized weights, and this model has none"):
        LLM(folder, activation_dtype="int8", dtype="float32", kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="batch_invariant=True covers quantized layers .* holds float weights"):
        LLM(folder, batch_invariant=True, dtype="float32", kv_cache_memory="8MiB")


def test_the_flags_and_yaml_keys_set_the_fields(tmp_path):
    args = parse_args(["generate", "Hi", "--activation-dtype", "int8", "--batch-invariant"])
    assert args.engine_config == EngineConfig(activation_dtype="int8", batch_invariant=True)
    path = tmp_path / "config.yaml"
    path.write_text("activation_dtype: int8\nbatch_invariant: true\n")
    assert parse_args(["serve", "--config", str(path)]).engine_config == EngineConfig(activation_dtype="int8",
                                                                                       batch_invariant=True)


@pytest.mark.kernels
def test_int8_activations_run_on_request(make_tiny_model_dir, tmp_path, caplog):
    folder = str(make_tiny_model_dir(tmp_path, "llama"))
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.llm_engine"):
        llm = LLM(folder, quantization="int8", activation_dtype="int8", dtype="float32", kv_cache_memory="8MiB")
    assert (f"quantized matmuls (float32 activations): int8 below {INT8_TILES_FROM_ROWS} rows, int8_tiles from "
            f"{INT8_TILES_FROM_ROWS}") in caplog.text
    layer = llm.llm_engine.runner.model.layers[0].qkv_proj
    assert layer.matmul.kernel(torch.float32, 1) is compiled.quantized_linear_int8
    assert layer.matmul.kernel(torch.float32, INT8_TILES_FROM_ROWS) is compiled.quantized_linear_int8_tiles


def test_the_default_answers_as_the_float_path_does():
    """The default engine (the bundled Q4_1 GGUF run quantized, activations in the default dtype) gives the
    chat answer of the same weights dequantized: the int8 rounding of activations once turned it into French."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=20)
    answers = [LLM(None, quantization=quantization, kv_cache_memory="16MiB").chat(question, params, use_tqdm=False)
               [0].outputs[0].text for quantization in ("auto", "none")]
    assert answers[0] == answers[1]
    assert "Paris" in answers[0]


@pytest.mark.kernels
def test_the_profiler_names_the_kernel_that_ran(monkeypatch):
    monkeypatch.delenv(FORCE_VARIABLE, raising=False)
    layer = QuantizedLinear(quantize(torch.randn(32, 64), 4), matmul=QuantizedMatmul())
    with torch.profiler.profile() as profile:
        layer(torch.randn(2, 64))
    path = QuantizedMatmul().path(torch.float32, 2)
    assert path in ("rows", "int16") and f"pagedllm::quantized_linear_{path}" in {event.key for event in profile.key_averages()}
