"""Group-quantized weights: the two internal formats, GGUF blocks repacked onto them, and round-to-nearest
quantization of float weights.

A [rows, cols] weight is held in groups of `group_size` columns, each with a scale and, where the
source has one, a minimum: value = scale * q + min. 4 bits: q in 0..15; 8 bits: q a signed byte.
The layout is tiled for the kernels' dot products: rows go in tiles of 16 (the last one padded
with zeros), and within a tile the weights of 4 consecutive columns of all 16 rows sit together
(64 values: [tile, cols / 4, 16 rows, 4 cols]), so one vector instruction meets one broadcast
group of 4 activations with 16 output rows at once and each lane accumulates its own row: no
horizontal sums. 4-bit tiles pack two such 64-value slots per 64 bytes (slot 2p in the low
nibbles, 2p + 1 in the high ones). Scales and mins are [tile, groups, 16 rows].
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

from pagedllm.model.tensor_parallel import Shard

_SUPER_BLOCK = 256   # the K-quants' block


TILE_ROWS = 16


@dataclass
class QuantizedWeight:
    """A group-quantized [rows, cols] weight in the tiled layout; `source` names where it came from
    (a GGUF type, int8, int4)."""
    qweight: torch.Tensor         # 4 bits: uint8 [tiles, cols * 8]; 8 bits: int8 [tiles, cols * 16]
    scales: torch.Tensor          # [tiles, groups * 16], float16 or float32
    mins: torch.Tensor | None     # like scales, or None (value = scale * q)
    bits: int
    group_size: int
    source: str
    num_rows: int                 # rows before the last tile's padding

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.qweight.shape[1] // (8 if self.bits == 4 else TILE_ROWS)

    @property
    def format(self) -> tuple[int, int, torch.dtype, bool]:
        """What the kernels dispatch on: weights of one format can be stacked into one matmul."""
        return self.bits, self.group_size, self.scales.dtype, self.mins is not None

    @property
    def padded(self) -> bool:
        return self.num_rows % TILE_ROWS != 0

    def to(self, device: torch.device) -> QuantizedWeight:
        return QuantizedWeight(self.qweight.to(device), self.scales.to(device),
                               None if self.mins is None else self.mins.to(device), self.bits, self.group_size,
                               self.source, self.num_rows)

    def values(self) -> torch.Tensor:
        """q as [tiles * 16, cols] (padding rows included), undoing the tiling."""
        tiles, cols = self.qweight.shape[0], self.shape[1]
        if self.bits == 4:
            packed = self.qweight.view(tiles, cols // 8, 1, 64)
            q = torch.cat([packed & 0x0F, packed >> 4], dim=2)   # slots 2p, 2p + 1
        else:
            q = self.qweight
        return q.reshape(tiles, cols // 4, TILE_ROWS, 4).permute(0, 2, 1, 3).reshape(tiles * TILE_ROWS, cols)

    def group_params(self, params: torch.Tensor) -> torch.Tensor:
        """Scales or mins as [tiles * 16, groups]."""
        tiles = params.shape[0]
        return params.view(tiles, -1, TILE_ROWS).transpose(1, 2).reshape(tiles * TILE_ROWS, -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """value = scale * q + min in float32, then dtype; the PyTorch formula the kernels are checked against."""
        rows, cols = self.shape
        q = self.values()[:rows].float().view(rows, -1, self.group_size)
        values = q * self.group_params(self.scales)[:rows].float().unsqueeze(-1)
        if self.mins is not None:
            values = values + self.group_params(self.mins)[:rows].float().unsqueeze(-1)
        return values.reshape(rows, cols).to(dtype)

    def dequantize_rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` only (an embedding lookup): each row's own bytes are gathered out of its tile, not the
        tile's 16 rows (a 32,768-token prefill gathered 300 MB of tiles for 19 MB of rows)."""
        tiles, cols = self.qweight.shape[0], self.shape[1]
        tile, row = index // TILE_ROWS, index % TILE_ROWS
        # A 64-byte slot holds 4 bytes of each of the tile's 16 rows: gathered as one int32 per slot and row.
        words = self.qweight.view(torch.int32).view(tiles, -1, TILE_ROWS)[tile, :, row]   # [n, slots]
        packed = words.view(self.qweight.dtype).view(len(index), words.shape[1], 4)      # [n, slots, 4]
        if self.bits == 4:   # low nibbles one slot of 4 columns, high nibbles the next
            q = torch.stack([packed & 0x0F, packed >> 4], dim=2)                          # [n, cols / 8, 2, 4]
        else:
            q = packed                                                                    # [n, cols / 4, 4]
        q = q.reshape(len(index), cols // self.group_size, self.group_size).float()

        def params(p: torch.Tensor) -> torch.Tensor:
            return p.view(tiles, -1, TILE_ROWS)[tile, :, row].float().unsqueeze(-1)

        values = q * params(self.scales) + (params(self.mins) if self.mins is not None else 0)
        return values.reshape(len(index), cols).to(dtype)


def tiled(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, group_size: int,
          source: str) -> QuantizedWeight:
    """The tiled QuantizedWeight of q [rows, cols] (values, one per element) and scales/mins [rows, groups]."""
    rows, cols = q.shape
    padding = -rows % TILE_ROWS
    tiles = (rows + padding) // TILE_ROWS

    def params(p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None:
            return None
        p = torch.nn.functional.pad(p, (0, 0, 0, padding))
        return p.view(tiles, TILE_ROWS, -1).transpose(1, 2).contiguous().view(tiles, -1)

    slots = torch.nn.functional.pad(q, (0, 0, 0, padding)).view(tiles, TILE_ROWS, cols // 4, 4).permute(0, 2, 1, 3)
    if bits == 4:
        pairs = slots.reshape(tiles, cols // 8, 2, 64)
        packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).to(torch.uint8)
    else:
        packed = slots.to(torch.int8)
    return QuantizedWeight(packed.reshape(tiles, -1).contiguous(), params(scales), params(mins), bits, group_size,
                           source, rows)


def stack_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one format stacked along rows (fused Q/K/V or gate/up); only the last may be padded."""
    first = weights[0]
    if any(w.format != first.format for w in weights) or any(w.padded for w in weights[:-1]):
        raise ValueError("only weights of one quantized format, unpadded but for the last, stack")
    mins = None if first.mins is None else torch.cat([w.mins for w in weights])
    return QuantizedWeight(torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]), mins,
                           first.bits, first.group_size, "+".join(dict.fromkeys(w.source for w in weights)),
                           sum(w.num_rows for w in weights))


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1 quants [..., 16] -> values [..., 32]: element j in byte j's low nibble, j + 16 in its high."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


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
    return _nibbles(raw[:, 2:]), d, -8 * d


def _repack_q4_1(raw):
    return _nibbles(raw[:, 4:]), _halves(raw, 0), _halves(raw, 2)


def _repack_q8_0(raw):
    return raw[:, 2:].view(np.int8), _halves(raw, 0), None


def _repack_q4_k(raw):
    # Each 32 bytes of quants hold two sub-blocks: the first in the low nibbles, the second in the high.
    pairs = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (pairs & 0x0F).reshape(-1, 8, 32)
    scales, mins = _k_groups(raw)
    return q, scales, mins


def _repack_q5_k(raw):
    high_bits = raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    pairs = raw[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (pairs & 0x0F).reshape(-1, 8, 32) | ((high_bits & 1) << 4)
    scales, mins = _k_groups(raw)
    return q.view(np.int8), scales, mins


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


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int],
              row_order: torch.Tensor | None = None, shard: Shard | None = None) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8, as gguf's reader maps them) in the internal format, exactly;
    row_order, if given, reorders the rows first (llama.cpp's q/k permutation undone). shard: only a
    tensor-parallel rank's part, cut before tiling (rows from the raw blocks; columns on group bounds)."""
    bits, group, scale_dtype, block_bytes, block_columns, repack = _GGUF_FORMATS[type_name]
    rows, cols = shape
    raw = np.ascontiguousarray(data).reshape(rows, cols // block_columns * block_bytes)
    if shard is not None and shard.dim == 0:
        start, stop = shard.bounds(rows)
        raw = raw[row_order[start:stop].numpy()] if row_order is not None else raw[start:stop]
        rows, row_order = stop - start, None
    elif row_order is not None:
        raw = raw[row_order.numpy()]
    q, scales, mins = repack(raw.reshape(rows * cols // block_columns, block_bytes))
    if scale_dtype == torch.float16 and not _fits_float16(scales, mins):
        scale_dtype = torch.float32   # -8 d of Q4_0 can leave float16's range; float32 holds it exactly
    column_shard = shard if shard is not None and shard.dim == 1 else None
    if column_shard is not None and (cols % shard.count or cols // shard.count % group):
        raise ValueError(f"a {type_name} weight of {cols} columns does not split into {shard.count} parts of "
                         f"whole {group}-column groups")

    def rows_of(values: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
        if values is None:
            return None
        tensor = torch.from_numpy(np.ascontiguousarray(values)).reshape(rows, -1).to(dtype)
        return tensor if column_shard is None else column_shard.of(tensor)

    return tiled(rows_of(q, torch.uint8 if bits == 4 else torch.int8), rows_of(scales, scale_dtype),
                 rows_of(mins, scale_dtype), bits, group, type_name)


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
        return tiled(q.reshape(rows, cols), scales, None, 8, 32, "int8")
    low, high = groups.amin(-1), groups.amax(-1)
    scales, mins = ((high - low) / 15).half(), low.half()
    q = torch.round((groups - mins.float().unsqueeze(-1)) / _nonzero(scales).unsqueeze(-1)).clamp(0, 15)
    return tiled(q.to(torch.uint8).reshape(rows, cols), scales, mins, 4, 32, "int4")


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """Scales as float32 divisors; an all-zero group (scale 0) quantizes to q = 0."""
    scales = scales.float()
    return torch.where(scales == 0, torch.ones_like(scales), scales)
