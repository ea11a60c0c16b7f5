// The tiled layout of group-quantized weights (pagedllm/model/quantization.py), shared by the matmul kernels:
// value = scale * q + min (min optional), groups of `group` columns; rows in tiles of 16, and in a tile
// the 16 rows' weights of 4 consecutive columns together (a 64-byte "slot", row n's 4 columns at bytes
// 4n..4n+3, so each 32-bit lane of a slot holds one row):
//   8 bits: int8 [tiles, cols / 4 slots, 16 rows, 4 cols];
//   4 bits: uint8 [tiles, cols / 8, 64]: slot 2p in the low nibbles, slot 2p + 1 in the high ones.
// Scales and mins: [tiles, groups, 16 rows], float16 or float32 (float32 where float16 cannot hold
// the source's scale exactly, e.g. Q4_K's d * sub-scale).
#pragma once

#include <ATen/ATen.h>

#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace pagedllm {

constexpr int64_t kTileRows = 16;

// The weights' byte layout within one tile.
template <int bits>
struct TileLayout {
  static constexpr int64_t tile_bytes(int64_t cols) { return bits == 4 ? cols * 8 : cols * 16; }
  // q of (row, col) in a tile: the scalar paths read through this.
  static int32_t value(const uint8_t* tile, int64_t row, int64_t col) {
    const int64_t slot = col / 4, within = row * 4 + col % 4;
    if constexpr (bits == 4) {
      const uint8_t byte = tile[(slot / 2) * 64 + within];
      return slot % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
    } else {
      return reinterpret_cast<const int8_t*>(tile)[slot * 64 + within];
    }
  }
};

template <typename scale_t>
inline float param(const scale_t* params, int64_t group, int64_t row) {
  return static_cast<float>(params[group * kTileRows + row]);
}

inline void check_format(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                         int64_t bits, int64_t group, int64_t cols) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(bits == 8 ? (group == 32 || group == 16) : group == 32,
              "quantized weights: group size must be 32 (or 16 for 8 bits), got ", group);
  TORCH_CHECK(cols % 32 == 0, "quantized weights: columns must be a multiple of 32, got ", cols);
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "quantized weights: tensors must be contiguous");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "quantized weights: 4 bits are uint8, 8 bits int8");
  TORCH_CHECK(qweight.size(1) == (bits == 4 ? TileLayout<4>::tile_bytes(cols) : TileLayout<8>::tile_bytes(cols)),
              "quantized weights: tile width does not match the columns");
  TORCH_CHECK(scales.size(0) == qweight.size(0) && scales.size(1) == cols / group * kTileRows,
              "quantized weights: scales must be [tiles, groups * 16]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat, "quantized weights: float16 or float32 scales");
  if (mins) {
    TORCH_CHECK(mins->is_contiguous() && mins->sizes() == scales.sizes() && mins->scalar_type() == scales.scalar_type(),
                "quantized weights: mins must match the scales");
  }
}

// The checks every quantized matmul makes on x, out and bias against the weight. float_out_allowed: out (and
// bias) may be float32 whatever x is (brgemm's float sums of bfloat16 activations, for the LM head's logits).
inline void check_matmul(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                         const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                         const c10::optional<at::Tensor>& bias, int64_t bits, int64_t group, const char* name,
                         bool float_out_allowed = false) {
  const int64_t rows = x.size(0), out_features = out.size(1), tiles = qweight.size(0);
  check_format(qweight, scales, mins, bits, group, x.size(1));
  const bool float_out = float_out_allowed && out.scalar_type() == at::kFloat;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.size(0) == rows &&
              (out.scalar_type() == x.scalar_type() || float_out) && out_features <= tiles * kTileRows &&
              out_features > (tiles - 1) * kTileRows,
              name, ": x [rows, cols] and out [rows, out_features] in one dtype", float_out_allowed ? " (or out float32)" : "",
              ", out_features in the last tile");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out_features && bias->scalar_type() == out.scalar_type()),
              name, ": bias must be [out_features] in out's dtype");
}

// Calls fn(bits as a std::integral_constant, scales, mins) with the scales and mins (nullptr if none) as
// pointers of their type (float16 or float32).
template <typename Fn>
void dispatch_format(int64_t bits, const at::Tensor& scales, const c10::optional<at::Tensor>& mins, Fn&& fn) {
  auto with_type = [&](auto bits_constant, auto scale_type) {
    using scale_t = decltype(scale_type);
    const scale_t* no_mins = nullptr;
    fn(bits_constant, static_cast<const scale_t*>(scales.data_ptr<scale_t>()), mins ? mins->data_ptr<scale_t>() : no_mins);
  };
  const bool half = scales.scalar_type() == at::kHalf;
  if (bits == 4) {
    half ? with_type(std::integral_constant<int, 4>{}, c10::Half{}) : with_type(std::integral_constant<int, 4>{}, float{});
  } else {
    half ? with_type(std::integral_constant<int, 8>{}, c10::Half{}) : with_type(std::integral_constant<int, 8>{}, float{});
  }
}

// The scale type behind dispatch_format's pointers.
template <typename pointer_t>
using scale_type_of = std::remove_const_t<std::remove_pointer_t<pointer_t>>;

}  // namespace pagedllm
