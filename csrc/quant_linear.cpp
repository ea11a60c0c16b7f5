// Linear layers over group-quantized weights (pagedllm/model/quantization.py holds the formats):
// a [rows, cols] weight in groups of `group` columns, value = scale * q + min (min optional).
//   4 bits: uint8 [rows, cols / 2]; a group's byte j holds element j (low nibble) and j + 16 (high), q in 0..15.
//   8 bits: int8 [rows, cols], q signed.
// Scales and mins: [rows, cols / group], float16 or float32 (float32 where float16 cannot hold
// the source's scale exactly, e.g. Q4_K's d * sub-scale).
//
// quantized_linear serves few rows (decode): the activations are quantized to int8 per row and
// group (absmax / 127), as llama.cpp does with its Q8 activations, and each group is one integer
// dot product (AVX-512 VNNI, else AVX2 maddubs) scaled once. Weights are read once per call, at
// their packed size: decode is bound by that traffic. dequantize serves many rows (prefill): it
// writes float tiles that a float matmul then takes, where the arithmetic dominates.
#include "ops.h"
#include "vectors.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using pagedllm::broadcast;
using pagedllm::kLanes;
using pagedllm::narrow;
using pagedllm::vfloat;
typedef uint8_t vbytes __attribute__((vector_size(kLanes)));
typedef int8_t vsbytes __attribute__((vector_size(kLanes)));

inline vfloat to_floats(vbytes q) { return __builtin_convertvector(q, vfloat); }

// Groups are taken eight at a time: their eight sums fill one vector.
constexpr int64_t kGroupsPerStep = 8;

// Activation rows quantized per group: q in -127..127 (so the sign trick below cannot overflow),
// scale = absmax / 127, and scale * sum(q) for the weights' min term. The per-group arrays have
// a row stride rounded up to kGroupsPerStep, zero-padded, so a step can load eight at a time.
struct QuantizedRows {
  int64_t rows, cols, group, stride;
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum;

  const float* scales(int64_t r, int64_t g) const { return scale.data() + r * stride + g; }
  const float* sums(int64_t r, int64_t g) const { return scaled_sum.data() + r * stride + g; }
};

template <typename scalar_t>
QuantizedRows quantize_rows(const scalar_t* x, int64_t rows, int64_t cols, int64_t group) {
  const int64_t groups = cols / group, stride = (groups + kGroupsPerStep - 1) / kGroupsPerStep * kGroupsPerStep;
  QuantizedRows out{rows, cols, group, stride, std::vector<int8_t>(rows * cols), std::vector<float>(rows * stride),
                    std::vector<float>(rows * stride)};
  at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t rg = begin; rg < end; ++rg) {
      const int64_t r = rg / groups, g = rg % groups, start = r * cols + g * group;
      float absmax = 0.f;
      for (int64_t i = 0; i < group; ++i) absmax = std::max(absmax, std::abs(static_cast<float>(x[start + i])));
      const float scale = absmax / 127.f, inverse = absmax > 0.f ? 127.f / absmax : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < group; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(static_cast<float>(x[start + i]) * inverse));
        out.q[start + i] = static_cast<int8_t>(q);
        sum += q;
      }
      out.scale[r * stride + g] = scale;
      out.scaled_sum[r * stride + g] = scale * static_cast<float>(sum);
    }
  });
  return out;
}

#if defined(__AVX2__)
// Eight int32 sums of four u8 * s8 products each.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else   // u <= 128 and |s| <= 127 here, so the pairwise int16 sums cannot saturate
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 32 weights of a 4-bit group as unsigned bytes, in element order.
inline __m256i unpack_nibbles(const uint8_t* packed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The dot products of eight groups (one vector of eight partial sums per 32 bytes) reduced to one
// vector holding each group's sum, in group order.
inline __m256i sum_groups(const __m256i* d, int64_t group) {
  const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  if (group == 16) {   // halves of each 32 bytes are groups 2c, 2c + 1: [0 2 4 6 | 1 3 5 7] -> [0 ... 7]
    return _mm256_permutevar8x32_epi32(h0123, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20), _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

// Eight float16/float32 group parameters as floats, zero beyond n.
template <typename scale_t>
inline __m256 load_params(const scale_t* p, int64_t n) {
  alignas(32) float values[kGroupsPerStep] = {};
  for (int64_t i = 0; i < n; ++i) values[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(values);
}
#endif

// One weight row against up to kTile activation rows: each step unpacks eight groups of weights
// once, and every row of the tile meets them. Returns the integer-exact dot products scaled by
// weight and activation scales, plus the weights' min term.
constexpr int kTile = 4;

template <int bits, typename scale_t>
void dot_weight_row(float* result, const void* weight_row, const scale_t* scales, const scale_t* mins,
                    const QuantizedRows& a, int64_t first_row, int tile) {
  const int64_t groups = a.cols / a.group;
#if defined(__AVX2__)
  __m256 acc[kTile], min_acc[kTile];
  for (int t = 0; t < tile; ++t) acc[t] = min_acc[t] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupsPerStep) {
    const int64_t step_groups = std::min(kGroupsPerStep, groups - g0), chunks = step_groups * a.group / 32;
    const int64_t start = g0 * a.group;
    alignas(32) uint8_t unsigned_weights[kGroupsPerStep][32];   // |w| as bytes, 32 columns a chunk
    const int8_t* signed_weights = static_cast<const int8_t*>(weight_row) + start;
    for (int64_t c = 0; c < chunks; ++c) {
      __m256i u;
      if constexpr (bits == 4) {
        u = unpack_nibbles(static_cast<const uint8_t*>(weight_row) + start / 2 + c * 16);
      } else {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(signed_weights + c * 32));
        u = _mm256_sign_epi8(w, w);
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(unsigned_weights[c]), u);
    }
    const __m256 w_scales = load_params(scales + g0, step_groups);
    const __m256 w_mins = mins != nullptr ? load_params(mins + g0, step_groups) : _mm256_setzero_ps();
    for (int t = 0; t < tile; ++t) {
      const int64_t r = first_row + t;
      const int8_t* activations = a.q.data() + r * a.cols + start;
      __m256i d[kGroupsPerStep];
      for (int64_t c = 0; c < kGroupsPerStep; ++c) {
        if (c >= chunks) {
          d[c] = _mm256_setzero_si256();
          continue;
        }
        __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(activations + c * 32));
        if constexpr (bits == 8) {   // the weights' signs moved onto the activations: |w| * sign(w) a
          s = _mm256_sign_epi8(s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(signed_weights + c * 32)));
        }
        d[c] = dot_u8s8(_mm256_load_si256(reinterpret_cast<const __m256i*>(unsigned_weights[c])), s);
      }
      const __m256 sums = _mm256_cvtepi32_ps(sum_groups(d, a.group));
      acc[t] = _mm256_fmadd_ps(sums, _mm256_mul_ps(w_scales, _mm256_loadu_ps(a.scales(r, g0))), acc[t]);
      if (mins != nullptr) min_acc[t] = _mm256_fmadd_ps(w_mins, _mm256_loadu_ps(a.sums(r, g0)), min_acc[t]);
    }
  }
  for (int t = 0; t < tile; ++t) result[t] = sum_lanes(_mm256_add_ps(acc[t], min_acc[t]));
#else   // any CPU: the same integer dot products, one element at a time
  for (int t = 0; t < tile; ++t) {
    const int64_t r = first_row + t;
    float total = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t i = g * a.group; i < (g + 1) * a.group; ++i) {
        int32_t w;
        if constexpr (bits == 4) {
          const uint8_t byte = static_cast<const uint8_t*>(weight_row)[(i / 32) * 16 + (i % 16)];
          w = (i % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
        } else {
          w = static_cast<const int8_t*>(weight_row)[i];
        }
        dot += w * a.q[r * a.cols + i];
      }
      total += static_cast<float>(scales[g]) * *a.scales(r, g) * static_cast<float>(dot);
      if (mins != nullptr) total += static_cast<float>(mins[g]) * *a.sums(r, g);
    }
    result[t] = total;
  }
#endif
}

void check_format(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                  int64_t bits, int64_t group, int64_t cols) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(bits == 8 ? (group == 32 || group == 16) : group == 32,
              "quantized weights: group size must be 32 (or 16 for 8 bits), got ", group);
  TORCH_CHECK(cols % 32 == 0, "quantized weights: columns must be a multiple of 32, got ", cols);
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "quantized weights: tensors must be contiguous");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "quantized weights: 4 bits are uint8, 8 bits int8");
  TORCH_CHECK(qweight.size(1) == (bits == 4 ? cols / 2 : cols), "quantized weights: packed width does not match the columns");
  TORCH_CHECK(scales.size(0) == qweight.size(0) && scales.size(1) == cols / group, "quantized weights: scales must be [rows, cols / group]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat, "quantized weights: float16 or float32 scales");
  if (mins) {
    TORCH_CHECK(mins->is_contiguous() && mins->sizes() == scales.sizes() && mins->scalar_type() == scales.scalar_type(),
                "quantized weights: mins must match the scales");
  }
}

// Calls fn with the format's bit count and scale type as template arguments.
template <typename Fn>
void dispatch_format(int64_t bits, const at::Tensor& scales, Fn&& fn) {
  const bool half = scales.scalar_type() == at::kHalf;
  if (bits == 4) {
    half ? fn(std::integral_constant<int, 4>{}, c10::Half{}) : fn(std::integral_constant<int, 4>{}, float{});
  } else {
    half ? fn(std::integral_constant<int, 8>{}, c10::Half{}) : fn(std::integral_constant<int, 8>{}, float{});
  }
}

}  // namespace

void quantized_linear(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                      c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group) {
  const int64_t rows = x.size(0), cols = x.size(1), out_features = qweight.size(0);
  check_format(qweight, scales, mins, bits, group, cols);
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.size(0) == rows && out.size(1) == out_features &&
              out.scalar_type() == x.scalar_type(), "quantized_linear: x [rows, cols] and out [rows, out_features], one dtype");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out_features && bias->scalar_type() == x.scalar_type()),
              "quantized_linear: bias must be [out_features] in x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantized_linear", [&] {
    const QuantizedRows a = quantize_rows(x.data_ptr<scalar_t>(), rows, cols, group);
    scalar_t* result = out.data_ptr<scalar_t>();
    const scalar_t* bias_values = bias ? bias->data_ptr<scalar_t>() : nullptr;
    dispatch_format(bits, scales, [&](auto bits_constant, auto scale_type) {
      constexpr int kBits = decltype(bits_constant)::value;
      using scale_t = decltype(scale_type);
      const scale_t* all_scales = scales.data_ptr<scale_t>();
      const scale_t* all_mins = mins ? mins->data_ptr<scale_t>() : nullptr;
      const int64_t groups = cols / group, row_bytes = qweight.size(1);
      const auto* weights = static_cast<const uint8_t*>(qweight.data_ptr());
      at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
        float dots[kTile];
        for (int64_t n = begin; n < end; ++n) {
          const float b = bias_values ? static_cast<float>(bias_values[n]) : 0.f;
          for (int64_t r = 0; r < rows; r += kTile) {
            const int tile = static_cast<int>(std::min<int64_t>(kTile, rows - r));
            dot_weight_row<kBits, scale_t>(dots, weights + n * row_bytes, all_scales + n * groups,
                                           all_mins ? all_mins + n * groups : nullptr, a, r, tile);
            for (int t = 0; t < tile; ++t) result[(r + t) * out_features + n] = static_cast<scalar_t>(dots[t] + b);
          }
        }
      });
    });
  });
}

void dequantize(at::Tensor out, at::Tensor qweight, at::Tensor scales, c10::optional<at::Tensor> mins,
                int64_t bits, int64_t group) {
  const int64_t rows = qweight.size(0), cols = out.size(1);
  check_format(qweight, scales, mins, bits, group, cols);
  TORCH_CHECK(out.is_contiguous() && out.size(0) == rows, "dequantize: out must be contiguous [rows, cols]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize", [&] {
    scalar_t* result = out.data_ptr<scalar_t>();
    dispatch_format(bits, scales, [&](auto bits_constant, auto scale_type) {
      constexpr int kBits = decltype(bits_constant)::value;
      using scale_t = decltype(scale_type);
      const scale_t* all_scales = scales.data_ptr<scale_t>();
      const scale_t* all_mins = mins ? mins->data_ptr<scale_t>() : nullptr;
      const int64_t groups = cols / group, row_bytes = qweight.size(1);
      const auto* weights = static_cast<const uint8_t*>(qweight.data_ptr());
      at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          const uint8_t* row = weights + n * row_bytes;
          for (int64_t g = 0; g < groups; ++g) {
            const vfloat scale = broadcast(static_cast<float>(all_scales[n * groups + g]));
            const vfloat min = broadcast(all_mins ? static_cast<float>(all_mins[n * groups + g]) : 0.f);
            scalar_t* dst = result + n * cols + g * group;
            // scale * q is exact for every source format (see quantization.py), so a fused
            // multiply-add rounds as gguf's separate multiply and add do.
            if constexpr (kBits == 4) {
              vbytes bytes;
              std::memcpy(&bytes, row + g * 16, sizeof(bytes));
              narrow(to_floats(bytes & 0x0F) * scale + min, dst);
              narrow(to_floats(bytes >> 4) * scale + min, dst + kLanes);
            } else {
              for (int64_t i = 0; i < group; i += kLanes) {
                vsbytes bytes;
                std::memcpy(&bytes, row + g * group + i, sizeof(bytes));
                narrow(__builtin_convertvector(bytes, vfloat) * scale + min, dst + i);
              }
            }
          }
        }
      });
    });
  });
}
