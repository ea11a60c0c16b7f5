"""Group-quantized weights: the two internal formats, GGUF blocks repacked onto them, and round-to-nearest
quantization of float weights.

A [rows, cols] weight is held in groups of `group_size` columns, each with a scale and, where the
source has one, a minimum: value = scale * q + min.
- 4 bits: q in 0..15, packed two per byte; a group's byte j holds element j (low nibble) and
  element j + 16 (high nibble), Q4_0's own order, so one 16-byte load unpacks a group.
- 8 bits: q a signed byte.
Every common GGUF type maps onto one of them exactly (scale * q is exact in float32 for each, so
scale * q + min rounds as gguf's dequantization does; the tests check it element for element):
| GGUF | format | group | scale, min |
|---|---|---|---|
| Q4_0 | 4 bits | 32 | d, -8 d (float16) |
| Q4_1 | 4 bits | 32 | d, m (float16) |
| Q8_0 | 8 bits | 32 | d, none (float16) |
| Q4_K | 4 bits | 32 | d * sc, -dmin * m (float32: the product needs 17 bits) |
| Q5_K | 8 bits (q in 0..31) | 32 | d * sc, -dmin * m (float32) |
| Q6_K | 8 bits (q - 32) | 16 | d * sc, none (float32) |
The compiled kernels (csrc/quant_linear.cpp) read these tensors as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_SUPER_BLOCK = 256   # the K-quants' block


@dataclass
class QuantizedWeight:
    """A group-quantized [rows, cols] weight; `source` names where it came from (a GGUF type, int8, int4)."""
    qweight: torch.Tensor         # 4 bits: uint8 [rows, cols // 2]; 8 bits: int8 [rows, cols]
    scales: torch.Tensor          # [rows, cols // group_size], float16 or float32
    mins: torch.Tensor | None     # like scales, or None (value = scale * q)
    bits: int
    group_size: int
    source: str

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qweight.shape
        return rows, width * 2 if self.bits == 4 else width

    @property
    def format(self) -> tuple[int, int, torch.dtype, bool]:
        """What the kernels dispatch on: weights of one format can be stacked into one matmul."""
        return self.bits, self.group_size, self.scales.dtype, self.mins is not None

    @property
    def nbytes(self) -> int:
        parts = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(part.numel() * part.element_size() for part in parts)

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The given rows (an index tensor or a slice), same format."""
        return QuantizedWeight(self.qweight[index], self.scales[index],
                               None if self.mins is None else self.mins[index], self.bits, self.group_size,
                               self.source)

    def to(self, device: torch.device) -> QuantizedWeight:
        return QuantizedWeight(self.qweight.to(device), self.scales.to(device),
                               None if self.mins is None else self.mins.to(device), self.bits, self.group_size,
                               self.source)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """value = scale * q + min in float32, then dtype; the PyTorch formula the kernels are checked against."""
        if self.bits == 4:
            packed = self.qweight.view(self.qweight.shape[0], -1, 16)
            q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        else:
            q = self.qweight.view(self.qweight.shape[0], -1, self.group_size).float()
        values = q * self.scales.float().unsqueeze(-1)
        if self.mins is not None:
            values = values + self.mins.float().unsqueeze(-1)
        return values.reshape(self.shape).to(dtype)


def stack_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one format stacked along rows (fused Q/K/V or gate/up)."""
    first = weights[0]
    if any(w.format != first.format for w in weights):
        raise ValueError("only weights of one quantized format stack")
    mins = None if first.mins is None else torch.cat([w.mins for w in weights])
    return QuantizedWeight(torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]), mins,
                           first.bits, first.group_size, "+".join(dict.fromkeys(w.source for w in weights)))


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q: uint8 [..., groups, 32] in 0..15 -> [..., groups * 16] in the 4-bit layout."""
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(*q.shape[:-2], -1)


def _halves(raw: np.ndarray, start: int, count: int = 1) -> np.ndarray:
    """count float16 values at byte `start` of each block, as float32."""
    return raw[:, start:start + 2 * count].copy().view(np.float16).astype(np.float32)


def _k_scales_and_mins(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the eight 6-bit sub-block scales and mins of each super block, from bytes 4..15."""
    packed = raw[:, 4:16].reshape(-1, 3, 4)
    low, high, rest = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_groups(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per 32-column group, scale = d * sc and min = -(dmin * m), as gguf forms them."""
    d, dmin = _halves(raw, 0), _halves(raw, 2)
    sc, m = _k_scales_and_mins(raw)
    return d * sc, -(dmin * m)


def _repack_q4_0(raw):
    d = _halves(raw, 0)
    return raw[:, 2:], d, -8 * d


def _repack_q4_1(raw):
    return raw[:, 4:], _halves(raw, 0), _halves(raw, 2)


def _repack_q8_0(raw):
    return raw[:, 2:].view(np.int8), _halves(raw, 0), None


def _repack_q4_k(raw):
    # Each 32 bytes of quants hold two sub-blocks: the first in the low nibbles, the second in the high.
    pairs = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (pairs & 0x0F).reshape(-1, 8, 32)
    scales, mins = _k_groups(raw)
    return _pack_nibbles(q), scales, mins


def _repack_q5_k(raw):
    high_bits = raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    pairs = raw[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (pairs & 0x0F).reshape(-1, 8, 32) | ((high_bits & 1) << 4)
    scales, mins = _k_groups(raw)
    return q.reshape(raw.shape[0], -1).view(np.int8), scales, mins


def _repack_q6_k(raw):
    low = raw[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & 0x0F).reshape(-1, 8, 32)
    high = raw[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(-1, 8, 32)
    q = (low | (high << 4)).view(np.int8) - np.int8(32)
    scales = raw[:, 192:208].view(np.int8).astype(np.float32) * _halves(raw, 208)
    return q.reshape(raw.shape[0], -1), scales, None


# GGUF type name -> (bits, group size, scale dtype, bytes per block, columns per block, repack function).
_GGUF_FORMATS = {
    "Q4_0": (4, 32, torch.float16, 18, 32, _repack_q4_0),
    "Q4_1": (4, 32, torch.float16, 20, 32, _repack_q4_1),
    "Q8_0": (8, 32, torch.float16, 34, 32, _repack_q8_0),
    "Q4_K": (4, 32, torch.float32, 144, _SUPER_BLOCK, _repack_q4_k),
    "Q5_K": (8, 32, torch.float32, 176, _SUPER_BLOCK, _repack_q5_k),
    "Q6_K": (8, 16, torch.float32, 210, _SUPER_BLOCK, _repack_q6_k),
}
GGUF_QUANTIZED_TYPES = frozenset(_GGUF_FORMATS)


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8, as gguf's reader maps them) in the internal format, exactly."""
    bits, group, scale_dtype, block_bytes, block_columns, repack = _GGUF_FORMATS[type_name]
    rows, cols = shape
    raw = np.ascontiguousarray(data).reshape(rows * cols // block_columns, block_bytes)
    q, scales, mins = repack(raw)
    if scale_dtype == torch.float16 and not _fits_float16(scales, mins):
        scale_dtype = torch.float32   # -8 d of Q4_0 can leave float16's range; float32 holds it exactly

    def tensor(values: np.ndarray | None, dtype: torch.dtype, width: int) -> torch.Tensor | None:
        if values is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(rows, width).to(dtype)

    width = cols // 2 if bits == 4 else cols
    return QuantizedWeight(tensor(q, torch.uint8 if bits == 4 else torch.int8, width),
                           tensor(scales, scale_dtype, cols // group), tensor(mins, scale_dtype, cols // group),
                           bits, group, type_name)


def _fits_float16(*arrays: np.ndarray | None) -> bool:
    return all(a is None or np.abs(a).max(initial=0) <= np.finfo(np.float16).max for a in arrays)


def quantize(weight: torch.Tensor, bits: int) -> QuantizedWeight:
    """Round-to-nearest group quantization of a float weight, groups of 32 with float16 scales:
    8 bits symmetric (scale = absmax / 127), 4 bits with a minimum (scale = (max - min) / 15)."""
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"int{bits} quantization needs columns in multiples of 32, got {cols}")
    groups = weight.float().reshape(rows, cols // 32, 32)
    if bits == 8:
        scales = (groups.abs().amax(-1) / 127).half()
        q = torch.round(groups / _nonzero(scales).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(q.reshape(rows, cols), scales, None, 8, 32, "int8")
    low, high = groups.amin(-1), groups.amax(-1)
    scales, mins = ((high - low) / 15).half(), low.half()
    q = torch.round((groups - mins.float().unsqueeze(-1)) / _nonzero(scales).unsqueeze(-1)).clamp(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return QuantizedWeight(packed.reshape(rows, cols // 2), scales, mins, 4, 32, "int4")


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """Scales as float32 divisors; an all-zero group (scale 0) quantizes to q = 0."""
    scales = scales.float()
    return torch.where(scales == 0, torch.ones_like(scales), scales)
