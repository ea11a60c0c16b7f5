// The opt-in int8-activation matmul (activation_dtype="int8") over the weights of quant_format.h, and
// dequantize.
//
// quantized_linear_int8 quantizes the activations to int8 per row and group (absmax / 127, as
// llama.cpp's Q8 activations) and multiplies in integers: one instruction takes a slot (16 rows x
// 4 columns of weights) against 4 activations broadcast, each 32-bit lane summing one output row,
// so a group's sums come out per row with no horizontal reduction and are scaled once (VNNI
// vpdpbusd on AVX-512, maddubs on AVX2). A tile's weights are unpacked once and met by up to 8
// activation rows. dequantize writes float rows (the reference the tests hold every path to).
#include "kept_scratch.h"
#include "ops.h"
#include "quant_format.h"
#include "vectors.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The VNNI bodies (vpdpbusd for int8, vpdpwssd for int16): the avx512vnni and avx512bf16 builds.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDLLM_VNNI 1
#endif

namespace {

using pagedllm::broadcast;
using pagedllm::kLanes;
using pagedllm::narrow;
using pagedllm::vfloat;
using pagedllm::widen;

using pagedllm::check_format;
using pagedllm::KeptScratch;
using pagedllm::check_matmul;
using pagedllm::dispatch_format;
using pagedllm::scale_type_of;
using pagedllm::kTileRows;
using pagedllm::param;
using pagedllm::TileLayout;

// Activation rows that meet a tile's unpacked weights together: as many as the registers hold (AVX2 has 16).
#if defined(__AVX512F__)
constexpr int kRowBlock = 8;
#else
constexpr int kRowBlock = 4;
#endif

// Activation rows quantized per group to q_t (int8: the int8 paths; int16: the int16 path): q in -qmax..qmax
// (so negating one cannot overflow), scale = absmax / qmax, and scale * sum(q) for the weights' min term. The
// arrays are the calling thread's KeptScratch (tags 10-13).
template <typename q_t>
constexpr float kQMax = std::is_same_v<q_t, int8_t> ? 127.f : 32767.f;

template <typename q_t>
struct QuantizedRows {
  int64_t rows, cols, group;
  KeptScratch<q_t, 10> q_storage;                                 // [rows, cols]
  KeptScratch<float, 11> scale_storage;                           // [rows, groups]
  KeptScratch<float, 12> scaled_sum_storage;                      // [rows, groups]
  KeptScratch<int32_t, 13> sum_storage;   // [rows, groups]: sum(q), for the int8 tiles kernel's 8-bit weights
  const q_t* q;
  const float *scale, *scaled_sum;
  const int32_t* sum;
};

// One group's q (x * qmax / absmax rounded to nearest, ties to even); returns sum(q), sets *scale.
template <typename q_t, typename scalar_t>
int32_t quantize_group(const scalar_t* x, int64_t group, q_t* q, float* scale) {
  constexpr float qmax = kQMax<q_t>;
#if defined(__AVX512F__)
  // The scalar loop's arithmetic, 16 lanes at a time: the same float products, rounded by the current mode
  // (nearest even) as nearbyint rounds them. Groups are 16 or 32 columns.
  __m512 absmax_lanes = _mm512_setzero_ps();
  for (int64_t i = 0; i < group; i += kLanes) absmax_lanes = _mm512_max_ps(absmax_lanes, _mm512_abs_ps((__m512)widen(x + i)));
  const float absmax = _mm512_reduce_max_ps(absmax_lanes);
  const __m512 inverse = _mm512_set1_ps(absmax > 0.f ? qmax / absmax : 0.f);
  __m512i sums = _mm512_setzero_si512();
  for (int64_t i = 0; i < group; i += kLanes) {
    const __m512i values = _mm512_cvtps_epi32(_mm512_mul_ps((__m512)widen(x + i), inverse));
    if constexpr (std::is_same_v<q_t, int8_t>) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(values));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm512_cvtepi32_epi16(values));
    }
    sums = _mm512_add_epi32(sums, values);
  }
  *scale = absmax / qmax;
  return _mm512_reduce_add_epi32(sums);
#elif defined(__AVX2__)
  // As above, 8 lanes at a time (kLanes is 8 in AVX2 builds).
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  __m256 absmax_lanes = _mm256_setzero_ps();
  for (int64_t i = 0; i < group; i += kLanes) absmax_lanes = _mm256_max_ps(absmax_lanes, _mm256_andnot_ps(sign_bit, (__m256)widen(x + i)));
  const __m128 half_max = _mm_max_ps(_mm256_castps256_ps128(absmax_lanes), _mm256_extractf128_ps(absmax_lanes, 1));
  const __m128 quarter_max = _mm_max_ps(half_max, _mm_movehl_ps(half_max, half_max));
  const float absmax = _mm_cvtss_f32(_mm_max_ss(quarter_max, _mm_movehdup_ps(quarter_max)));
  const __m256 inverse = _mm256_set1_ps(absmax > 0.f ? qmax / absmax : 0.f);
  __m256i sums = _mm256_setzero_si256();
  for (int64_t i = 0; i < group; i += kLanes) {
    const __m256i values = _mm256_cvtps_epi32(_mm256_mul_ps((__m256)widen(x + i), inverse));
    // Packed to 16 bits (then 8): in range, so saturation never applies; the permute undoes packs' lane order.
    const __m128i halves = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi32(values, values), 0x08));
    if constexpr (std::is_same_v<q_t, int8_t>) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(halves, halves));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), halves);
    }
    sums = _mm256_add_epi32(sums, values);
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sums);
  *scale = absmax / qmax;
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
#else
  float absmax = 0.f;
  for (int64_t i = 0; i < group; ++i) absmax = std::max(absmax, std::abs(static_cast<float>(x[i])));
  const float inverse = absmax > 0.f ? qmax / absmax : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < group; ++i) {
    const int32_t value = static_cast<int32_t>(std::nearbyint(static_cast<float>(x[i]) * inverse));
    q[i] = static_cast<q_t>(value);
    sum += value;
  }
  *scale = absmax / qmax;
  return sum;
#endif
}

// padded_rows (>= rows): room for whole row blocks; the rows past `rows` hold whatever the storage held (a
// kernel computes them and writes nothing of them).
template <typename q_t, typename scalar_t>
QuantizedRows<q_t> quantize_rows(const scalar_t* x, int64_t rows, int64_t cols, int64_t group, int64_t padded_rows) {
  const int64_t groups = cols / group;
  QuantizedRows<q_t> result{rows, cols, group, KeptScratch<q_t, 10>(padded_rows * cols),
                            KeptScratch<float, 11>(padded_rows * groups), KeptScratch<float, 12>(padded_rows * groups),
                            KeptScratch<int32_t, 13>(padded_rows * groups)};
  // By pointer: inside the workers, the scratch would be their own thread's.
  q_t* q_data = result.q_storage.data();
  float *scale_data = result.scale_storage.data(), *scaled_sum_data = result.scaled_sum_storage.data();
  int32_t* sum_data = result.sum_storage.data();
  at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t rg = begin; rg < end; ++rg) {
      const int64_t start = rg * group;   // rows are contiguous, so group rg starts at rg * group
      sum_data[rg] = quantize_group(x + start, group, q_data + start, &scale_data[rg]);
      scaled_sum_data[rg] = scale_data[rg] * static_cast<float>(sum_data[rg]);
    }
  });
  result.q = q_data;
  result.scale = scale_data;
  result.scaled_sum = scaled_sum_data;
  result.sum = sum_data;
  return result;
}

using Int8Rows = QuantizedRows<int8_t>;

#if defined(PAGEDLLM_VNNI)
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// A tile's count scales or mins (a multiple of 16: a group's weight rows) widened to float into a panel, a vector at
// a time (one at a time, it took a few percent of a 1,536-column layer's many-row call: chunks there are 84 rows).
template <typename scale_t>
void widen_params(float* dst, const scale_t* src, int64_t count) {
  for (int64_t i = 0; i < count; i += kTileRows) _mm512_storeu_ps(dst + i, load16(src + i));
}

// A group's int32 sums added to a row's float sums: sums * (the weights' scales * the row's scale), then the weights'
// mins * the row's scaled sum. Every integer body folds with it, so that their outputs are the same bits.
inline __m512 fold_group(__m512 acc, __m512i sums, __m512 w_scales, __m512 w_mins, bool with_mins, float scale,
                         float scaled_sum) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(w_scales, _mm512_set1_ps(scale)), acc);
  return with_mins ? _mm512_fmadd_ps(w_mins, _mm512_set1_ps(scaled_sum), acc) : acc;
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return _mm512_set1_epi32(four);
}

// out[r][0..15] for `block` activation rows against one tile: 16 lanes, one per weight row.
template <int bits, typename scale_t>
void tile_dots(float (*out)[kTileRows], const uint8_t* tile, const scale_t* scales, const scale_t* mins,
               const Int8Rows& a, int64_t first_row, int block) {
  const int64_t groups = a.cols / a.group, slots_per_group = a.group / 4;
  __m512 acc[kRowBlock];
  for (int r = 0; r < block; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    // Two sums per row, one per slot of a pair: independent chains keep vpdpbusd's latency hidden.
    __m512i sums[kRowBlock], sums_odd[kRowBlock];
    for (int r = 0; r < block; ++r) sums[r] = sums_odd[r] = _mm512_setzero_si512();
    for (int64_t s = g * slots_per_group; s < (g + 1) * slots_per_group; s += 2) {   // two slots a step
      __m512i w0, w1;
      __mmask64 negative0 = 0, negative1 = 0;
      if constexpr (bits == 4) {
        const __m512i packed = _mm512_loadu_si512(tile + (s / 2) * 64);
        w0 = _mm512_and_si512(packed, low_nibbles);
        w1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      } else {   // vpdpbusd takes unsigned x signed: |w| against the activations negated where w < 0
        const __m512i signed0 = _mm512_loadu_si512(tile + s * 64), signed1 = _mm512_loadu_si512(tile + (s + 1) * 64);
        negative0 = _mm512_movepi8_mask(signed0);
        negative1 = _mm512_movepi8_mask(signed1);
        w0 = _mm512_abs_epi8(signed0);
        w1 = _mm512_abs_epi8(signed1);
      }
      for (int r = 0; r < block; ++r) {
        const int8_t* activations = a.q + (first_row + r) * a.cols + s * 4;
        __m512i a0 = broadcast4(activations), a1 = broadcast4(activations + 4);
        if constexpr (bits == 8) {
          a0 = _mm512_mask_sub_epi8(a0, negative0, _mm512_setzero_si512(), a0);
          a1 = _mm512_mask_sub_epi8(a1, negative1, _mm512_setzero_si512(), a1);
        }
        sums[r] = _mm512_dpbusd_epi32(sums[r], w0, a0);
        sums_odd[r] = _mm512_dpbusd_epi32(sums_odd[r], w1, a1);
      }
    }
    const __m512 w_scales = load16(scales + g * kTileRows);
    const __m512 w_mins = mins != nullptr ? load16(mins + g * kTileRows) : _mm512_setzero_ps();
    for (int r = 0; r < block; ++r) {
      const int64_t ag = (first_row + r) * groups + g;
      acc[r] = fold_group(acc[r], _mm512_add_epi32(sums[r], sums_odd[r]), w_scales, w_mins, mins != nullptr, a.scale[ag],
                          a.scaled_sum[ag]);
    }
  }
  for (int r = 0; r < block; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

// The many-row kernel (quantized_linear_int8_tiles): the same sums as tile_dots, register-blocked. A panel of
// kPanelTiles tiles is unpacked once per call into unsigned bytes in the slot order (4 bits: q; 8 bits: q + 128,
// each group's int32 sums starting from -128 sum(q_x) so they come out as tile_dots's) and float scales and mins;
// then kBlockRows activation rows at a time meet it, kBlockRows x kPanelTiles int32 sums per group (each
// activation broadcast once per slot, each weight vector loaded once per slot), each group folded into float
// sums exactly as tile_dots folds it, so every output is bitwise tile_dots's.
constexpr int kPanelTiles = 2;
constexpr int kBlockRows = 6;

struct Panel {
  std::vector<uint8_t> q;           // [kPanelTiles, slots, 64]
  std::vector<float> scales, mins;  // [kPanelTiles, groups * 16]; a missing last tile is zeros
};

template <int bits, typename scale_t>
void unpack_panel(Panel& panel, const uint8_t* tiles, int64_t tile_bytes, const scale_t* scales, const scale_t* mins,
                  int64_t params_per_tile, int count, int64_t slots) {
  panel.q.resize(kPanelTiles * slots * 64);
  panel.scales.resize(kPanelTiles * params_per_tile);
  panel.mins.resize(mins != nullptr ? kPanelTiles * params_per_tile : 0);
  for (int t = count; t < kPanelTiles; ++t) {   // a layer's last panel may lack tiles: their sums must be finite
    std::fill_n(panel.q.data() + t * slots * 64, slots * 64, uint8_t{0});
    std::fill_n(panel.scales.data() + t * params_per_tile, params_per_tile, 0.f);
    if (mins != nullptr) std::fill_n(panel.mins.data() + t * params_per_tile, params_per_tile, 0.f);
  }
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), sign_bits = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int t = 0; t < count; ++t) {
    const uint8_t* tile = tiles + t * tile_bytes;
    uint8_t* q = panel.q.data() + t * slots * 64;
    for (int64_t s = 0; s < slots; s += 2) {
      __m512i even, odd;
      if constexpr (bits == 4) {
        const __m512i packed = _mm512_loadu_si512(tile + (s / 2) * 64);
        even = _mm512_and_si512(packed, low_nibbles);
        odd = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      } else {
        even = _mm512_xor_si512(_mm512_loadu_si512(tile + s * 64), sign_bits);
        odd = _mm512_xor_si512(_mm512_loadu_si512(tile + (s + 1) * 64), sign_bits);
      }
      _mm512_storeu_si512(q + s * 64, even);
      _mm512_storeu_si512(q + (s + 1) * 64, odd);
    }
    widen_params(panel.scales.data() + t * params_per_tile, scales + t * params_per_tile, params_per_tile);
    if (mins != nullptr) widen_params(panel.mins.data() + t * params_per_tile, mins + t * params_per_tile, params_per_tile);
  }
}

// out[r][v * 16 + n] for activation rows first_row.. first_row + kBlockRows against the panel's tile v. The group's
// slots are a constant so that the slot loop unrolls: in a run-time loop GCC copied every sum in and out of the
// register vpdpbusd accumulates into, two moves per dot product.
template <int slots_per_group, bool offset, bool with_mins>
void panel_dots(float (*out)[kPanelTiles * kTileRows], const Panel& panel, int64_t slots, int64_t params_per_tile,
                const Int8Rows& a, int64_t first_row) {
  const int64_t groups = a.cols / a.group;
  __m512 acc[kBlockRows][kPanelTiles];
  for (int r = 0; r < kBlockRows; ++r) {
    for (int v = 0; v < kPanelTiles; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sums[kBlockRows][kPanelTiles];
    for (int r = 0; r < kBlockRows; ++r) {
      const __m512i start = offset ? _mm512_set1_epi32(-128 * a.sum[(first_row + r) * groups + g]) : _mm512_setzero_si512();
      for (int v = 0; v < kPanelTiles; ++v) sums[r][v] = start;
    }
#pragma GCC unroll 8
    for (int i = 0; i < slots_per_group; ++i) {
      const int64_t s = g * slots_per_group + i;
      __m512i w[kPanelTiles];
      for (int v = 0; v < kPanelTiles; ++v) w[v] = _mm512_loadu_si512(panel.q.data() + (v * slots + s) * 64);
      for (int r = 0; r < kBlockRows; ++r) {
        const __m512i x = broadcast4(a.q + (first_row + r) * a.cols + s * 4);
        for (int v = 0; v < kPanelTiles; ++v) sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], w[v], x);
      }
    }
    for (int v = 0; v < kPanelTiles; ++v) {
      const __m512 w_scales = _mm512_loadu_ps(panel.scales.data() + v * params_per_tile + g * kTileRows);
      const __m512 w_mins = with_mins ? _mm512_loadu_ps(panel.mins.data() + v * params_per_tile + g * kTileRows)
                                      : _mm512_setzero_ps();
      for (int r = 0; r < kBlockRows; ++r) {
        const int64_t ag = (first_row + r) * groups + g;
        acc[r][v] = fold_group(acc[r][v], sums[r][v], w_scales, w_mins, with_mins, a.scale[ag], a.scaled_sum[ag]);
      }
    }
  }
  for (int r = 0; r < kBlockRows; ++r) {
    for (int v = 0; v < kPanelTiles; ++v) _mm512_storeu_ps(out[r] + v * kTileRows, acc[r][v]);
  }
}
#elif defined(__AVX2__)
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// As the AVX-512 fold_group, for 8 weight rows.
inline __m256 fold_group(__m256 acc, __m256i sums, __m256 w_scales, __m256 w_mins, bool with_mins, float scale,
                         float scaled_sum) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(w_scales, _mm256_set1_ps(scale)), acc);
  return with_mins ? _mm256_fmadd_ps(w_mins, _mm256_set1_ps(scaled_sum), acc) : acc;
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return _mm256_set1_epi32(four);
}

// As the AVX-512 version, one half of the tile (8 weight rows: bytes 32 * half of each slot) at a time.
template <int bits, typename scale_t>
void tile_dots(float (*out)[kTileRows], const uint8_t* tile, const scale_t* scales, const scale_t* mins,
               const Int8Rows& a, int64_t first_row, int block) {
  const int64_t groups = a.cols / a.group, slots_per_group = a.group / 4;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[kRowBlock];
    for (int r = 0; r < block; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i sums[kRowBlock];
      for (int r = 0; r < block; ++r) sums[r] = _mm256_setzero_si256();
      for (int64_t s = g * slots_per_group; s < (g + 1) * slots_per_group; s += 2) {
        __m256i w0, w1, signed0, signed1;
        if constexpr (bits == 4) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (s / 2) * 64 + 32 * half));
          w0 = _mm256_and_si256(packed, low_nibbles);
          w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
        } else {   // maddubs takes unsigned x signed: |w| against the activations with w's signs
          signed0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + s * 64 + 32 * half));
          signed1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (s + 1) * 64 + 32 * half));
          w0 = _mm256_sign_epi8(signed0, signed0);
          w1 = _mm256_sign_epi8(signed1, signed1);
        }
        for (int r = 0; r < block; ++r) {
          const int8_t* activations = a.q + (first_row + r) * a.cols + s * 4;
          __m256i a0 = broadcast4(activations), a1 = broadcast4(activations + 4);
          if constexpr (bits == 8) {
            a0 = _mm256_sign_epi8(a0, signed0);
            a1 = _mm256_sign_epi8(a1, signed1);
          }
          // 4 bits: |15 * 127| * 2 per int16 pair, two slots summed still fit int16; 8 bits: 128 * 127 * 2 fits once.
          if constexpr (bits == 4) {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0, a0), _mm256_maddubs_epi16(w1, a1));
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, ones));
          } else {
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, a0), ones));
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, a1), ones));
          }
        }
      }
      const __m256 w_scales = load8(scales + g * kTileRows + 8 * half);
      const __m256 w_mins = mins != nullptr ? load8(mins + g * kTileRows + 8 * half) : _mm256_setzero_ps();
      for (int r = 0; r < block; ++r) {
        const int64_t ag = (first_row + r) * groups + g;
        acc[r] = fold_group(acc[r], sums[r], w_scales, w_mins, mins != nullptr, a.scale[ag], a.scaled_sum[ag]);
      }
    }
    for (int r = 0; r < block; ++r) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);
  }
}
#else   // any CPU: the same integer dot products, one element at a time
template <int bits, typename scale_t>
void tile_dots(float (*out)[kTileRows], const uint8_t* tile, const scale_t* scales, const scale_t* mins,
               const Int8Rows& a, int64_t first_row, int block) {
  const int64_t groups = a.cols / a.group;
  for (int r = 0; r < block; ++r) {
    const int64_t row = first_row + r;
    for (int64_t n = 0; n < kTileRows; ++n) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int64_t c = g * a.group; c < (g + 1) * a.group; ++c) {
          dot += TileLayout<bits>::value(tile, n, c) * a.q[row * a.cols + c];
        }
        total += param(scales, g, n) * a.scale[row * groups + g] * static_cast<float>(dot);
        if (mins != nullptr) total += param(mins, g, n) * a.scaled_sum[row * groups + g];
      }
      out[r][n] = total;
    }
  }
}
#endif

// The int16 path (quantized_linear_int16): activations quantized per row and group to int16 (absmax / 32767, 256
// times int8's resolution), so on CPUs without bfloat16 products the integers multiply at twice float32's rate:
// AVX2's vpmaddwd multiplies 16 int16 pairs and sums each pair into an int32 lane, as an FMA does 8 floats, and
// AVX-512 VNNI's vpdpwssd multiplies 32 pairs and adds them in one instruction, issued as often as an FMA of 16
// floats (Ice Lake: two a cycle, ~4.9 G a second a core, measured in a register-only loop).
// Both bodies hold a tile's q values as column pairs with one weight row a 32-bit lane, so that a lane's products
// sum one weight row: few rows expand them from the packed tiles in registers (int16_direct_dots), many meet them
// widened once per chunk of rows into a panel (int16_panel_dots). Per group the int32 sums are folded into float
// sums as the int8 paths fold theirs, in the same arithmetic on every build. Every row's result is the same
// whatever rows it shares the call with.
using Int16Rows = QuantizedRows<int16_t>;
constexpr int kHalfRows = kTileRows / 2;
constexpr int kInt16BlockRows = 4;   // activation rows per pass over a panel

constexpr int64_t kInt16ChunkBytes = 256 << 10;   // int16 activations met by a thread's tiles in turn: within L2

#if defined(PAGEDLLM_VNNI) || defined(__AVX2__)
// The few-row int16 body: a tile's q values go from the packed tile into the integer products in registers, with no
// panel. A lane of a packed load is one weight row; vpshufb turns its bytes (b0, b1, b2, b3) into (b0, b2, b1, b3),
// so that each 16-bit half of the lane holds one column's q (4 bits: masked nibbles at shifts 0, 8, 4, 12 give the
// column pairs 0-1, 2-3, 4-5, 6-7 of the load's 8 columns; 8 bits: sign-extended bytes give 0-1 and 2-3 of its
// 4), and the pair meets the activations of those two columns, broadcast as one 32-bit word in their natural
// order (vpdpwssd on VNNI, vpmaddwd and an addition on AVX2). Each lane then sums its own weight row, so a group's
// int32 sums are the panel bodies' integers (exact) and are folded by the same arithmetic: every output is bitwise
// theirs. Few activation rows keep several chains of sums per row (added at the group's end, exactly) to
// hide the products' latency. The next tile's line at the same offset is prefetched (see prefetch_ahead in
// quant_matmul.cpp: without it the 8-bit LM head at one row read 14 GB/s).
#if defined(PAGEDLLM_VNNI)
constexpr int kInt16DirectBlockRows = 8;   // activation rows per pass: 8 x 2 chains of int32 sums, 8 float sums
// Up to this many rows the direct body is at least as fast as the panels (Ice Lake, each way in turn in short
// alternating processes, median time panel / direct: 3072 x 576 at 8 rows 1.62, at 16 1.02; 576 x 1536 1.46 and
// 1.15).
constexpr int64_t kInt16DirectUpToRows = 16;

// A 64-byte line of a packed tile as its column pairs (4 bits: 4 pairs; 8 bits: 2), one weight row a 32-bit lane.
template <int bits>
inline void expand_line(__m512i* w, const uint8_t* line) {
  const __m512i pair_bytes = _mm512_set4_epi32(0x0F0D0E0C, 0x0B090A08, 0x07050604, 0x03010200);
  const __m512i low_nibbles = _mm512_set1_epi32(0x000F000F);
  const __m512i packed = _mm512_shuffle_epi8(_mm512_loadu_si512(line), pair_bytes);
  if constexpr (bits == 4) {
    w[0] = _mm512_and_si512(packed, low_nibbles);
    w[1] = _mm512_and_si512(_mm512_srli_epi32(packed, 8), low_nibbles);
    w[2] = _mm512_and_si512(_mm512_srli_epi32(packed, 4), low_nibbles);
    w[3] = _mm512_and_si512(_mm512_srli_epi32(packed, 12), low_nibbles);
  } else {
    w[0] = _mm512_srai_epi16(_mm512_slli_epi16(packed, 8), 8);
    w[1] = _mm512_srai_epi16(packed, 8);
  }
}

template <int bits, int group, int block, bool with_mins, typename scale_t>
void int16_direct_dots(float (*out)[kTileRows], const uint8_t* tile, const scale_t* scales, const scale_t* mins,
                       const Int16Rows& a, int64_t first_row, int64_t tile_bytes, int64_t params_per_tile) {
  constexpr int kColsPerLoad = bits == 4 ? 8 : 4, kPairsPerLoad = kColsPerLoad / 2;
  constexpr int kChains = block <= 2 ? 4 : 2;
  const int64_t groups = a.cols / group;
  __m512 acc[block];
  for (int r = 0; r < block; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sums[block][kChains];
    for (int r = 0; r < block; ++r) {
      for (int k = 0; k < kChains; ++k) sums[r][k] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int i = 0; i < group / kColsPerLoad; ++i) {
      const int64_t col = g * group + i * kColsPerLoad;
      const uint8_t* line = tile + col / kColsPerLoad * 64;
      __builtin_prefetch(line + tile_bytes, 0, 3);
      __m512i w[kPairsPerLoad];
      expand_line<bits>(w, line);
#pragma GCC unroll 8
      for (int r = 0; r < block; ++r) {
        const int16_t* x = a.q + (first_row + r) * a.cols + col;
#pragma GCC unroll 4
        for (int p = 0; p < kPairsPerLoad; ++p) {
          int32_t pair;
          std::memcpy(&pair, x + 2 * p, sizeof(pair));
          const int k = (i * kPairsPerLoad + p) % kChains;
          sums[r][k] = _mm512_dpwssd_epi32(sums[r][k], w[p], _mm512_set1_epi32(pair));
          __asm__("" : "+v"(sums[r][k]));   // each sum stays in its register (see the AVX2 int16_panel_dots)
        }
      }
    }
    __builtin_prefetch(scales + g * kTileRows + params_per_tile, 0, 3);
    if (with_mins) __builtin_prefetch(mins + g * kTileRows + params_per_tile, 0, 3);
    const __m512 w_scales = load16(scales + g * kTileRows);
    const __m512 w_mins = with_mins ? load16(mins + g * kTileRows) : _mm512_setzero_ps();
    for (int r = 0; r < block; ++r) {
      const int64_t ag = (first_row + r) * groups + g;
      __m512i row_sums = sums[r][0];
      for (int k = 1; k < kChains; ++k) row_sums = _mm512_add_epi32(row_sums, sums[r][k]);
      acc[r] = fold_group(acc[r], row_sums, w_scales, w_mins, with_mins, a.scale[ag], a.scaled_sum[ag]);
    }
  }
  for (int r = 0; r < block; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

#else   // AVX2: 16 registers, so half a tile (8 weight rows, 32 bytes of each 64-byte line) a pass
// 32 bytes of a packed line (8 weight rows) as its column pairs (4 bits: 4 pairs; 8 bits: 2), one weight row a lane.
template <int bits>
inline void expand_line(__m256i* w, const uint8_t* half_line) {
  const __m256i pair_bytes = _mm256_setr_epi32(0x03010200, 0x07050604, 0x0B090A08, 0x0F0D0E0C, 0x03010200, 0x07050604,
                                               0x0B090A08, 0x0F0D0E0C);
  const __m256i low_nibbles = _mm256_set1_epi32(0x000F000F);
  const __m256i packed =
      _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half_line)), pair_bytes);
  if constexpr (bits == 4) {
    w[0] = _mm256_and_si256(packed, low_nibbles);
    w[1] = _mm256_and_si256(_mm256_srli_epi32(packed, 8), low_nibbles);
    w[2] = _mm256_and_si256(_mm256_srli_epi32(packed, 4), low_nibbles);
    w[3] = _mm256_and_si256(_mm256_srli_epi32(packed, 12), low_nibbles);
  } else {
    w[0] = _mm256_srai_epi16(_mm256_slli_epi16(packed, 8), 8);
    w[1] = _mm256_srai_epi16(packed, 8);
  }
}

// Activation rows per pass: 5 int32 sums, 5 float sums, one weight vector. A speculative verification of 4 tokens
// (5 rows) thus reads each tile once: as 4 + 1 rows it took 1.18x the time (`bench kernels --rows 5`, summed over
// the bundled model's shapes; docs/quantized_matmul.md).
constexpr int kInt16DirectBlockRows = 5;
constexpr int64_t kInt16DirectUpToRows = 16;   // the VNNI body's; at 16 rows it also beat brgemm (Ice Lake, avx2 build)

template <int bits, int group, int block, bool with_mins, typename scale_t>
void int16_direct_dots(float (*out)[kTileRows], const uint8_t* tile, const scale_t* scales, const scale_t* mins,
                       const Int16Rows& a, int64_t first_row, int64_t tile_bytes, int64_t params_per_tile) {
  constexpr int kColsPerLoad = bits == 4 ? 8 : 4, kPairsPerLoad = kColsPerLoad / 2;
  constexpr int kChains = block <= 2 ? 2 : 1;
  const int64_t groups = a.cols / group;
  constexpr int kLoadsPerGroup = group / kColsPerLoad;
  for (int half = 0; half < 2; ++half) {
    __m256 acc[block];
    for (int r = 0; r < block; ++r) acc[r] = _mm256_setzero_ps();
    // The group's first line and each row's first activation of the group, advanced once a group: within it every
    // load and broadcast is a constant offset from these (the addresses computed per load from the column were a
    // quarter of the 5-row body's instructions).
    const uint8_t* group_lines = tile;
    const int16_t* group_q[block];
    for (int r = 0; r < block; ++r) group_q[r] = a.q + (first_row + r) * a.cols;
    for (int64_t g = 0; g < groups; ++g, group_lines += kLoadsPerGroup * 64) {
      __m256i sums[block][kChains];
      for (int r = 0; r < block; ++r) {
        for (int k = 0; k < kChains; ++k) sums[r][k] = _mm256_setzero_si256();
      }
#pragma GCC unroll 8
      for (int i = 0; i < kLoadsPerGroup; ++i) {
        const uint8_t* line = group_lines + i * 64;
        if (half == 0) __builtin_prefetch(line + tile_bytes, 0, 3);
        __m256i w[kPairsPerLoad];
        expand_line<bits>(w, line + 32 * half);
        // Up to 4 rows every weight vector of the load stays live (the 8-bit LM head at 4 rows 4% faster than
        // below); 5 rows' sums fit beside one weight vector only, so the rows take each vector in turn.
        constexpr bool kVectorOuter = block > 4;
#pragma GCC unroll 5
        for (int outer = 0; outer < (kVectorOuter ? kPairsPerLoad : block); ++outer) {
          if constexpr (kVectorOuter) __asm__("" : "+x"(w[outer]));   // computed here, not all ahead of the products
#pragma GCC unroll 5
          for (int inner = 0; inner < (kVectorOuter ? block : kPairsPerLoad); ++inner) {
            const int r = kVectorOuter ? inner : outer, p = kVectorOuter ? outer : inner;
            int32_t pair;
            std::memcpy(&pair, group_q[r] + i * kColsPerLoad + 2 * p, sizeof(pair));
            const int k = (i * kPairsPerLoad + p) % kChains;
            sums[r][k] = _mm256_add_epi32(sums[r][k], _mm256_madd_epi16(w[p], _mm256_set1_epi32(pair)));
            __asm__("" : "+x"(sums[r][k]));   // each sum stays in its register (see int16_panel_dots)
          }
        }
      }
      for (int r = 0; r < block; ++r) group_q[r] += group;
      if (half == 0) {
        __builtin_prefetch(scales + g * kTileRows + params_per_tile, 0, 3);
        if (with_mins) __builtin_prefetch(mins + g * kTileRows + params_per_tile, 0, 3);
      }
      const __m256 w_scales = load8(scales + g * kTileRows + half * kHalfRows);
      const __m256 w_mins = with_mins ? load8(mins + g * kTileRows + half * kHalfRows) : _mm256_setzero_ps();
      for (int r = 0; r < block; ++r) {
        const int64_t ag = (first_row + r) * groups + g;
        __m256i row_sums = sums[r][0];
        for (int k = 1; k < kChains; ++k) row_sums = _mm256_add_epi32(row_sums, sums[r][k]);
        acc[r] = fold_group(acc[r], row_sums, w_scales, w_mins, with_mins, a.scale[ag], a.scaled_sum[ag]);
      }
    }
    for (int r = 0; r < block; ++r) _mm256_storeu_ps(out[r] + half * kHalfRows, acc[r]);
  }
}
#endif

// int16_direct_dots for a run-time block of 1..kInt16DirectBlockRows rows.
template <int bits, int group, bool with_mins, typename scale_t, int block = kInt16DirectBlockRows>
void int16_direct_block(float (*out)[kTileRows], const uint8_t* tile, const scale_t* scales, const scale_t* mins,
                        const Int16Rows& a, int64_t first_row, int rows, int64_t tile_bytes, int64_t params_per_tile) {
  if constexpr (block > 1) {
    if (rows < block) {
      return int16_direct_block<bits, group, with_mins, scale_t, block - 1>(out, tile, scales, mins, a, first_row, rows,
                                                                             tile_bytes, params_per_tile);
    }
  }
  int16_direct_dots<bits, group, block, with_mins>(out, tile, scales, mins, a, first_row, tile_bytes, params_per_tile);
}
#endif

// Many rows: kInt16PanelTiles tiles' column pairs expanded once per chunk of rows (expand_line over every line, in
// column order), then kInt16BlockRows activation rows at a time meet all of them, each activation pair broadcast
// once for the panel's tiles and each weight vector loaded once for the block's rows. The direct body at many rows
// loads a broadcast per product and is bound by the loads, and so is a panel of one tile at 8 rows. Rows x tiles a
// pass, each against 4 x 3 in turn in short alternating processes (Ice Lake, 3072 x 576 at 128 rows and 576 x 1536
// at 512, 2 threads, median time ratio): 6 x 2 1.30 / 1.17, 4 x 4 1.07 / 1.17, 5 x 3 1.06 / 1.16; the slot-order
// panel this replaced (8 rows of one tile, each row's two lanes a weight row gathered by two permutes a group)
// took 1.10 / 1.16 times 6 x 2's. The same integer sums and the same fold as int16_direct_dots: the same bits.
// AVX2 builds meet one tile a pass: 4 rows x 16 weight rows of int32 sums (8 registers), the pair's two weight
// vectors and a broadcast, the float sums kept in `out`; as fast as the slot-order panel it replaced there (a vector
// of 4 weight rows x 4 columns, each row's two lanes added by vphaddd at every group's end), with one layout for
// every build. The generic build: the same sums, one element at a time.
#if defined(PAGEDLLM_VNNI)
constexpr int kInt16PanelTiles = 3;
#else
constexpr int kInt16PanelTiles = 1;
#endif

struct alignas(64) ColumnPair {
  int16_t q[32];   // lane n: weight row n's q of the pair's two columns
};

struct Int16PairPanel {
  std::vector<ColumnPair> pairs;     // [kInt16PanelTiles, columns / 2]
  std::vector<float> scales, mins;   // [kInt16PanelTiles, params per tile]; a missing last tile is zeros
};

#if !defined(PAGEDLLM_VNNI)
// A tile's count scales or mins (a multiple of 16) widened to float into a panel.
template <typename scale_t>
void widen_params(float* dst, const scale_t* src, int64_t count) {
#if defined(__AVX2__)
  for (int64_t i = 0; i < count; i += kHalfRows) _mm256_storeu_ps(dst + i, load8(src + i));
#else
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i]);
#endif
}
#endif

// The column pairs of one load of a tile (4 bits: 8 columns, 8 bits: 4) from column col, its 16 weight rows, into
// a panel.
template <int bits>
inline void expand_load(ColumnPair* pairs, const uint8_t* tile, int64_t col) {
  constexpr int kColsPerLoad = bits == 4 ? 8 : 4, kPairsPerLoad = kColsPerLoad / 2;
  const uint8_t* line = tile + col / kColsPerLoad * 64;
#if defined(PAGEDLLM_VNNI)
  expand_line<bits>(reinterpret_cast<__m512i*>(pairs), line);
#elif defined(__AVX2__)
  for (int half = 0; half < 2; ++half) {
    __m256i w[kPairsPerLoad];
    expand_line<bits>(w, line + 32 * half);
    for (int p = 0; p < kPairsPerLoad; ++p) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[p].q + 2 * kHalfRows * half), w[p]);
    }
  }
#else
  for (int p = 0; p < kPairsPerLoad; ++p) {
    for (int n = 0; n < kTileRows; ++n) {
      for (int c = 0; c < 2; ++c) {
        pairs[p].q[2 * n + c] = static_cast<int16_t>(TileLayout<bits>::value(tile, n, col + 2 * p + c));
      }
    }
  }
#endif
}

template <int bits, typename scale_t>
void expand_panel(Int16PairPanel& panel, const uint8_t* tiles, int64_t tile_bytes, const scale_t* scales,
                  const scale_t* mins, int64_t params_per_tile, int count, int64_t cols) {
  constexpr int kColsPerLoad = bits == 4 ? 8 : 4;
  const int64_t pairs = cols / 2;
  panel.pairs.resize(kInt16PanelTiles * pairs);
  panel.scales.assign(kInt16PanelTiles * params_per_tile, 0.f);   // a layer's last panel may lack a tile: its sums
  panel.mins.assign(mins != nullptr ? kInt16PanelTiles * params_per_tile : 0, 0.f);   // must be finite
  for (int t = count; t < kInt16PanelTiles; ++t) {
    std::fill_n(panel.pairs.data() + t * pairs, pairs, ColumnPair{});
  }
  for (int t = 0; t < count; ++t) {
    const uint8_t* tile = tiles + t * tile_bytes;
    for (int64_t col = 0; col < cols; col += kColsPerLoad) {
      expand_load<bits>(panel.pairs.data() + t * pairs + col / 2, tile, col);
    }
    widen_params(panel.scales.data() + t * params_per_tile, scales + t * params_per_tile, params_per_tile);
    if (mins != nullptr) widen_params(panel.mins.data() + t * params_per_tile, mins + t * params_per_tile, params_per_tile);
  }
}

#if defined(PAGEDLLM_VNNI)
// out[r][v * 16 + n] for activation rows first_row.. first_row + kInt16BlockRows against the panel's tile v. The
// group's pairs are a constant so that their loop unrolls.
template <int pairs_per_group, bool with_mins>
void int16_panel_dots(float (*out)[kInt16PanelTiles * kTileRows], const Int16PairPanel& panel, int64_t params_per_tile,
                      const Int16Rows& a, int64_t first_row) {
  const int64_t groups = a.cols / a.group, pairs = a.cols / 2;
  __m512 acc[kInt16BlockRows][kInt16PanelTiles];
  for (int r = 0; r < kInt16BlockRows; ++r) {
    for (int v = 0; v < kInt16PanelTiles; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sums[kInt16BlockRows][kInt16PanelTiles];
    for (int r = 0; r < kInt16BlockRows; ++r) {
      for (int v = 0; v < kInt16PanelTiles; ++v) sums[r][v] = _mm512_setzero_si512();
    }
#pragma GCC unroll 16
    for (int i = 0; i < pairs_per_group; ++i) {
      const int64_t pair_index = g * pairs_per_group + i;
      __m512i w[kInt16PanelTiles];
      for (int v = 0; v < kInt16PanelTiles; ++v) w[v] = _mm512_load_si512(panel.pairs.data() + v * pairs + pair_index);
#pragma GCC unroll 8
      for (int r = 0; r < kInt16BlockRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, a.q + (first_row + r) * a.cols + 2 * pair_index, sizeof(pair));
        const __m512i x = _mm512_set1_epi32(pair);
        for (int v = 0; v < kInt16PanelTiles; ++v) {
          sums[r][v] = _mm512_dpwssd_epi32(sums[r][v], w[v], x);
          __asm__("" : "+v"(sums[r][v]));   // each sum stays in its register (see the AVX2 int16_panel_dots)
        }
      }
    }
    for (int v = 0; v < kInt16PanelTiles; ++v) {
      const __m512 w_scales = _mm512_loadu_ps(panel.scales.data() + v * params_per_tile + g * kTileRows);
      const __m512 w_mins = with_mins ? _mm512_loadu_ps(panel.mins.data() + v * params_per_tile + g * kTileRows)
                                      : _mm512_setzero_ps();
      for (int r = 0; r < kInt16BlockRows; ++r) {
        const int64_t ag = (first_row + r) * groups + g;
        acc[r][v] = fold_group(acc[r][v], sums[r][v], w_scales, w_mins, with_mins, a.scale[ag], a.scaled_sum[ag]);
      }
    }
  }
  for (int r = 0; r < kInt16BlockRows; ++r) {
    for (int v = 0; v < kInt16PanelTiles; ++v) _mm512_storeu_ps(out[r] + v * kTileRows, acc[r][v]);
  }
}
#elif defined(__AVX2__)
// out[r][n] for activation rows first_row.. first_row + kInt16BlockRows against the panel's tile, both halves of
// its weight rows a pass (each activation pair broadcast once for them); the group's pairs are a constant so that
// their loop unrolls.
template <int pairs_per_group, bool with_mins>
void int16_panel_dots(float (*out)[kInt16PanelTiles * kTileRows], const Int16PairPanel& panel, int64_t,
                      const Int16Rows& a, int64_t first_row) {
  const int64_t groups = a.cols / a.group;
  for (int r = 0; r < kInt16BlockRows; ++r) std::fill_n(out[r], kTileRows, 0.f);
  const ColumnPair* group_pairs = panel.pairs.data();
  const int16_t* group_q[kInt16BlockRows];   // each row's first activation of the group
  for (int r = 0; r < kInt16BlockRows; ++r) group_q[r] = a.q + (first_row + r) * a.cols;
  for (int64_t g = 0; g < groups; ++g, group_pairs += pairs_per_group) {
    __m256i sums[kInt16BlockRows][2];   // weight rows 0-7 and 8-15
    for (int r = 0; r < kInt16BlockRows; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int i = 0; i < pairs_per_group; ++i) {
      const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(group_pairs[i].q));
      const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(group_pairs[i].q + 2 * kHalfRows));
#pragma GCC unroll 4
      for (int r = 0; r < kInt16BlockRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, group_q[r] + 2 * i, sizeof(pair));
        const __m256i x = _mm256_set1_epi32(pair);
        sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(w0, x));
        sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(w1, x));
        // Keeps each sum in its register: without it GCC hoists the unrolled products above their additions and
        // spills them (a quarter of the speed).
        __asm__("" : "+x"(sums[r][0]), "+x"(sums[r][1]));
      }
    }
    for (int r = 0; r < kInt16BlockRows; ++r) group_q[r] += 2 * pairs_per_group;
    for (int half = 0; half < 2; ++half) {
      const __m256 w_scales = _mm256_loadu_ps(panel.scales.data() + g * kTileRows + half * kHalfRows);
      const __m256 w_mins = with_mins ? _mm256_loadu_ps(panel.mins.data() + g * kTileRows + half * kHalfRows)
                                      : _mm256_setzero_ps();
      for (int r = 0; r < kInt16BlockRows; ++r) {
        const int64_t ag = (first_row + r) * groups + g;
        float* acc = out[r] + half * kHalfRows;
        _mm256_storeu_ps(acc, fold_group(_mm256_loadu_ps(acc), sums[r][half], w_scales, w_mins, with_mins,
                                         a.scale[ag], a.scaled_sum[ag]));
      }
    }
  }
}
#else   // the same sums, one element at a time
template <int pairs_per_group, bool with_mins>
void int16_panel_dots(float (*out)[kInt16PanelTiles * kTileRows], const Int16PairPanel& panel, int64_t,
                      const Int16Rows& a, int64_t first_row) {
  const int64_t groups = a.cols / a.group;
  for (int r = 0; r < kInt16BlockRows; ++r) {
    const int16_t* x = a.q + (first_row + r) * a.cols;
    for (int n = 0; n < kTileRows; ++n) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int64_t i = g * pairs_per_group; i < (g + 1) * pairs_per_group; ++i) {
          for (int c = 0; c < 2; ++c) dot += panel.pairs[i].q[2 * n + c] * x[2 * i + c];
        }
        const int64_t ag = (first_row + r) * groups + g;
        total = std::fma(static_cast<float>(dot), panel.scales[g * kTileRows + n] * a.scale[ag], total);
        if (with_mins) total = std::fma(panel.mins[g * kTileRows + n], a.scaled_sum[ag], total);
      }
      out[r][n] = total;
    }
  }
}
#endif

typedef uint8_t vbytes __attribute__((vector_size(kLanes)));
typedef int8_t vsbytes __attribute__((vector_size(kLanes)));

// One tile's q values back to row-major [16, cols] bytes: 4 bytes per row from each slot.
template <int bits>
void untile(uint8_t* dst, const uint8_t* tile, int64_t cols) {
  const int64_t slots = cols / 4;
  for (int64_t s = 0; s < slots; ++s) {
    uint8_t slot[64];
    if constexpr (bits == 4) {
      const uint8_t* packed = tile + (s / 2) * 64;
      const int shift = s % 2 == 0 ? 0 : 4;
      for (int i = 0; i < 64; ++i) slot[i] = (packed[i] >> shift) & 0x0F;
    } else {
      std::memcpy(slot, tile + s * 64, 64);
    }
    for (int64_t n = 0; n < kTileRows; ++n) std::memcpy(dst + n * cols + s * 4, slot + n * 4, 4);
  }
}

// The integer entries' set-up: the checks (before any size is read), the activations quantized to q_t (room for
// rows_padded_to rows), and the weight format dispatched; run(a, result, bias_values, bits_constant, scales, mins)
// multiplies.
template <typename q_t, typename Run>
void with_quantized_operands(const char* name, at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                             c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group,
                             int64_t rows_padded_to, Run run) {
  check_matmul(out, x, qweight, scales, mins, bias, bits, group, name);
  const int64_t rows = x.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantized_linear_integer", [&] {
    const int64_t padded_rows = (rows + rows_padded_to - 1) / rows_padded_to * rows_padded_to;
    const QuantizedRows<q_t> a = quantize_rows<q_t>(x.data_ptr<scalar_t>(), rows, x.size(1), group, padded_rows);
    const scalar_t* bias_values = bias ? bias->data_ptr<scalar_t>() : nullptr;
    dispatch_format(bits, scales, mins, [&](auto bits_constant, auto all_scales, auto all_mins) {
      run(a, out.data_ptr<scalar_t>(), bias_values, bits_constant, all_scales, all_mins);
    });
  });
}

// count rows of float sums (width per row) plus the bias into the output, columns first_out.. first_out + valid.
template <int width, typename scalar_t>
void store_sums(scalar_t* result, const float (*sums)[width], const scalar_t* bias_values, int64_t first_row,
                int64_t count, int64_t first_out, int64_t valid, int64_t out_features) {
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t n = 0; n < valid; ++n) {
      const float value = sums[b][n] + (bias_values ? static_cast<float>(bias_values[first_out + n]) : 0.f);
      result[(first_row + b) * out_features + first_out + n] = static_cast<scalar_t>(value);
    }
  }
}

// Which threads run a call's tiles: the cores (at::parallel_for) or the calling thread alone (a share of a call
// whose threads are already running). runs(first, last, f) hands out equal runs of [first, last) as f(begin, end);
// each(f) runs f once on every thread.
struct OnCores {
  template <typename F>
  void runs(int64_t first, int64_t last, const F& f) const { at::parallel_for(first, last, 1, f); }
  template <typename F>
  void each(const F& f) const { at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { f(); }); }
};
struct OnThisThread {
  template <typename F>
  void runs(int64_t first, int64_t last, const F& f) const { f(first, last); }
  template <typename F>
  void each(const F& f) const { f(); }
};

// quantized_linear_int16's work on tiles [first_tile_of_call, last_tile_of_call) on threads (OnCores or
// OnThisThread). Few rows (VNNI and AVX2 builds) multiply straight from the packed tiles, each thread an equal run of
// them (one stream of weights a thread); more meet the tiles widened to int16 (panels), once per chunk of rows. Both
// give the same bits.
template <typename Threads>
void int16_matmul(const char* name, const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                  const at::Tensor& scales, const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                  int64_t bits, int64_t group, int64_t first_tile_of_call, int64_t last_tile_of_call,
                  const Threads& threads) {
  with_quantized_operands<int16_t>(name, out, x, qweight, scales, mins, bias, bits, group, kInt16BlockRows,
                                   [&](const Int16Rows& a, auto* result, auto* bias_values, auto bits_constant,
                                       auto all_scales, auto all_mins) {
    constexpr int kBits = decltype(bits_constant)::value;
    using scale_t = scale_type_of<decltype(all_scales)>;
    const int64_t rows = x.size(0), out_features = out.size(1);
    const int64_t tile_bytes = qweight.size(1), params_per_tile = scales.size(1);
    const auto* weights = static_cast<const uint8_t*>(qweight.data_ptr());
    auto mins_of = [&](int64_t t) { return all_mins ? all_mins + t * params_per_tile : nullptr; };
#if defined(PAGEDLLM_VNNI) || defined(__AVX2__)
    if (rows <= kInt16DirectUpToRows) {
      const auto direct = group == 32 ? (all_mins != nullptr ? &int16_direct_block<kBits, 32, true, scale_t>
                                                             : &int16_direct_block<kBits, 32, false, scale_t>)
                                      : (all_mins != nullptr ? &int16_direct_block<kBits, 16, true, scale_t>
                                                             : &int16_direct_block<kBits, 16, false, scale_t>);
      threads.runs(first_tile_of_call, last_tile_of_call, [&](int64_t begin, int64_t end) {
        float dots[kInt16DirectBlockRows][kTileRows];
        // As few passes as the block allows, of even sizes: 8 rows run as 4 + 4, not 5 + 3 (with VNNI, 9 as 5 + 4:
        // the same unpacks and products as 8 + 1).
        const int64_t passes = (rows + kInt16DirectBlockRows - 1) / kInt16DirectBlockRows;
        for (int64_t t = begin; t < end; ++t) {
          const int64_t first_out = t * kTileRows, valid = std::min<int64_t>(kTileRows, out_features - first_out);
          for (int64_t pass = 0, r = 0; pass < passes; ++pass) {
            const int block = static_cast<int>((rows - r) / (passes - pass));   // the rows left, shared evenly
            direct(dots, weights + t * tile_bytes, all_scales + t * params_per_tile, mins_of(t), a, r, block,
                   tile_bytes, params_per_tile);
            store_sums(result, dots, bias_values, r, block, first_out, valid, out_features);
            r += block;
          }
        }
      });
      return;
    }
#endif
    // Rows in chunks that stay in each core's L2 while the threads meet the chunk with every tile in turn (a
    // 2,048-row prefill's activations are 2.4 MB: met whole by each tile, they streamed from L3 once per tile); a
    // tile is unpacked again per chunk, a cost of 1 / chunk rows against its products.
    const int64_t row_bytes = x.size(1) * static_cast<int64_t>(sizeof(int16_t));
    const int64_t chunk_blocks = kInt16ChunkBytes / row_bytes / kInt16BlockRows;
    const int64_t chunk_rows = std::max<int64_t>(1, chunk_blocks) * kInt16BlockRows;
    // Units of (chunk of rows, tile or panel of tiles), claimed one at a time, chunk by chunk: a thread that starts
    // late or runs slower takes fewer of them (equal runs of tiles left the first thread waiting at the end).
    const int64_t tiles = last_tile_of_call - first_tile_of_call;
    const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
    std::atomic<int64_t> next_unit{0};
    // Groups of 32 columns are 16 pairs; 8-bit formats may have groups of 16 (8 pairs).
    const auto dots_of = group == 32 ? (all_mins != nullptr ? &int16_panel_dots<16, true> : &int16_panel_dots<16, false>)
                                     : (all_mins != nullptr ? &int16_panel_dots<8, true> : &int16_panel_dots<8, false>);
    const int64_t panels = (tiles + kInt16PanelTiles - 1) / kInt16PanelTiles;
    threads.each([&] {
      thread_local Int16PairPanel panel;   // kept from call to call: no allocation per call
      float dots[kInt16BlockRows][kInt16PanelTiles * kTileRows];
      for (int64_t unit; (unit = next_unit.fetch_add(1, std::memory_order_relaxed)) < chunks * panels;) {
        const int64_t chunk = unit / panels * chunk_rows, chunk_end = std::min(rows, chunk + chunk_rows);
        const int64_t t = first_tile_of_call + unit % panels * kInt16PanelTiles;
        const int count = static_cast<int>(std::min<int64_t>(kInt16PanelTiles, last_tile_of_call - t));
        expand_panel<kBits>(panel, weights + t * tile_bytes, tile_bytes, all_scales + t * params_per_tile, mins_of(t),
                            params_per_tile, count, x.size(1));
        const int64_t first_out = t * kTileRows, valid = std::min<int64_t>(count * kTileRows, out_features - first_out);
        for (int64_t r = chunk; r < chunk_end; r += kInt16BlockRows) {
          dots_of(dots, panel, params_per_tile, a, r);
          store_sums(result, dots, bias_values, r, std::min<int64_t>(kInt16BlockRows, rows - r), first_out, valid,
                     out_features);
        }
      }
    });
  });
}

}  // namespace

void quantized_linear_int8(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                           c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group) {
  RECORD_FUNCTION("pagedllm::quantized_linear_int8", std::vector<c10::IValue>({x, qweight}));   // torch.profiler names it
  with_quantized_operands<int8_t>("quantized_linear_int8", out, x, qweight, scales, mins, bias, bits, group, 1,
                     [&](const Int8Rows& a, auto* result, auto* bias_values, auto bits_constant, auto all_scales,
                         auto all_mins) {
    constexpr int kBits = decltype(bits_constant)::value;
    using scale_t = scale_type_of<decltype(all_scales)>;
    const int64_t rows = x.size(0), out_features = out.size(1), tiles = qweight.size(0);
    const int64_t tile_bytes = qweight.size(1), params_per_tile = scales.size(1);
    const auto* weights = static_cast<const uint8_t*>(qweight.data_ptr());
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      float dots[kRowBlock][kTileRows];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t first_out = t * kTileRows, valid = std::min(kTileRows, out_features - first_out);
        for (int64_t r = 0; r < rows; r += kRowBlock) {
          const int block = static_cast<int>(std::min<int64_t>(kRowBlock, rows - r));
          tile_dots<kBits, scale_t>(dots, weights + t * tile_bytes, all_scales + t * params_per_tile,
                                    all_mins ? all_mins + t * params_per_tile : nullptr, a, r, block);
          store_sums(result, dots, bias_values, r, block, first_out, valid, out_features);
        }
      }
    });
  });
}

void quantized_linear_int8_tiles(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                                 c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits,
                                 int64_t group) {
#if defined(PAGEDLLM_VNNI)
  RECORD_FUNCTION("pagedllm::quantized_linear_int8_tiles", std::vector<c10::IValue>({x, qweight}));
  with_quantized_operands<int8_t>("quantized_linear_int8_tiles", out, x, qweight, scales, mins, bias, bits, group, kBlockRows,
                     [&](const Int8Rows& a, auto* result, auto* bias_values, auto bits_constant, auto all_scales,
                         auto all_mins) {
    constexpr int kBits = decltype(bits_constant)::value;
    const int64_t rows = x.size(0), out_features = out.size(1), tiles = qweight.size(0);
    const int64_t slots = x.size(1) / 4, panels = (tiles + kPanelTiles - 1) / kPanelTiles;
    const int64_t tile_bytes = qweight.size(1), params_per_tile = scales.size(1);
    const auto* weights = static_cast<const uint8_t*>(qweight.data_ptr());
    // Groups of 32 columns are 8 slots; 8-bit formats may have groups of 16 (4 slots).
    const auto dots_of = group == 32 ? (all_mins != nullptr ? &panel_dots<8, kBits == 8, true> : &panel_dots<8, kBits == 8, false>)
                                     : (all_mins != nullptr ? &panel_dots<4, kBits == 8, true> : &panel_dots<4, kBits == 8, false>);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      thread_local Panel panel;   // kept from call to call: no allocation per call
      float dots[kBlockRows][kPanelTiles * kTileRows];
      for (int64_t p = begin; p < end; ++p) {
        const int64_t first_tile = p * kPanelTiles;
        const int count = static_cast<int>(std::min<int64_t>(kPanelTiles, tiles - first_tile));
        unpack_panel<kBits>(panel, weights + first_tile * tile_bytes, tile_bytes, all_scales + first_tile * params_per_tile,
                            all_mins ? all_mins + first_tile * params_per_tile : nullptr, params_per_tile, count, slots);
        const int64_t first_out = first_tile * kTileRows;
        const int64_t valid = std::min<int64_t>(count * kTileRows, out_features - first_out);
        for (int64_t r = 0; r < rows; r += kBlockRows) {
          dots_of(dots, panel, slots, params_per_tile, a, r);
          store_sums(result, dots, bias_values, r, std::min<int64_t>(kBlockRows, rows - r), first_out, valid, out_features);
        }
      }
    });
  });
#else   // no VNNI in this build: the int8 kernel (the same sums)
  quantized_linear_int8(out, x, qweight, scales, mins, bias, bits, group);
#endif
}

void quantized_linear_int16(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                            c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group) {
  RECORD_FUNCTION("pagedllm::quantized_linear_int16", std::vector<c10::IValue>({x, qweight}));
  int16_matmul("quantized_linear_int16", out, x, qweight, scales, mins, bias, bits, group, 0, qweight.size(0),
               OnCores{});
}

void quantized_linear_int16_share(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                                  const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                  const c10::optional<at::Tensor>& bias, int64_t bits, int64_t group,
                                  int64_t first_tile, int64_t last_tile) {
  TORCH_CHECK(0 <= first_tile && first_tile <= last_tile && last_tile <= qweight.size(0),
              "quantized_linear_int16_share: tiles must be a range within 0..", qweight.size(0));
  if (first_tile == last_tile) return;
  int16_matmul("quantized_linear_int16_share", out, x, qweight, scales, mins, bias, bits, group, first_tile, last_tile,
               OnThisThread{});
}

// One weight row's q values out of its tile, row-major: each of its 4-byte pieces of the tile's 64-byte slots.
template <int bits, typename q_t>
void untile_row(q_t* dst, const uint8_t* tile, int64_t row, int64_t cols) {
  for (int64_t s = 0; s < cols / 4; ++s) {
    for (int c = 0; c < 4; ++c) dst[s * 4 + c] = static_cast<q_t>(TileLayout<bits>::value(tile, row, s * 4 + c));
  }
}

void dequantize(at::Tensor out, at::Tensor qweight, at::Tensor scales, c10::optional<at::Tensor> mins,
                int64_t bits, int64_t group, c10::optional<at::Tensor> rows) {
  RECORD_FUNCTION("pagedllm::dequantize", std::vector<c10::IValue>({out}));   // torch.profiler names it
  const int64_t tiles = qweight.size(0), cols = out.size(1);
  check_format(qweight, scales, mins, bits, group, cols);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2, "dequantize: out must be contiguous [rows, cols]");
  if (rows) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->is_contiguous() &&
                rows->size(0) == out.size(0), "dequantize: rows must be contiguous int64 [out rows]");
  } else {
    TORCH_CHECK(out.size(0) == tiles * kTileRows, "dequantize: out must be [tiles * 16, cols] without rows");
  }
  const int64_t* row_ids = rows ? rows->data_ptr<int64_t>() : nullptr;   // nullptr for an empty rows too: test `rows`
  const int64_t count = out.size(0);
  for (int64_t i = 0; rows && i < count; ++i) {
    TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < tiles * kTileRows, "dequantize: row ", row_ids[i], " is outside 0..",
                tiles * kTileRows - 1);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize", [&] {
    scalar_t* result = out.data_ptr<scalar_t>();
    dispatch_format(bits, scales, mins, [&](auto bits_constant, auto all_scales, auto all_mins) {
      constexpr int kBits = decltype(bits_constant)::value;
      using scale_t = scale_type_of<decltype(all_scales)>;
      using q_t = std::conditional_t<kBits == 4, uint8_t, int8_t>;
      using q_vector_t = std::conditional_t<kBits == 4, vbytes, vsbytes>;
      const int64_t tile_bytes = qweight.size(1), params_per_tile = scales.size(1), groups = cols / group;
      const auto* weights = static_cast<const uint8_t*>(qweight.data_ptr());
      // Output row i is weight row `row` (its q values row-major in q) of tile t: scale * q + min per group.
      auto write_row = [&](scalar_t* dst, const q_t* q, int64_t t, int64_t row) {
        const scale_t* tile_scales = all_scales + t * params_per_tile;
        const scale_t* tile_mins = all_mins ? all_mins + t * params_per_tile : nullptr;
        for (int64_t g = 0; g < groups; ++g) {
          // scale * q is exact for every source format (see quantization.py), so a fused
          // multiply-add rounds as gguf's separate multiply and add do.
          const vfloat scale = broadcast(param(tile_scales, g, row));
          const vfloat min = broadcast(tile_mins ? param(tile_mins, g, row) : 0.f);
          for (int64_t c = g * group; c < (g + 1) * group; c += kLanes) {
            q_vector_t values;
            std::memcpy(&values, q + c, sizeof(values));
            narrow(__builtin_convertvector(values, vfloat) * scale + min, dst + c);
          }
        }
      };
      if (rows) {   // an embedding lookup: each row's own bytes, not its tile's 16 rows
        at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
          std::vector<q_t> values(cols);
          for (int64_t i = begin; i < end; ++i) {
            const int64_t t = row_ids[i] / kTileRows, row = row_ids[i] % kTileRows;
            untile_row<kBits>(values.data(), weights + t * tile_bytes, row, cols);
            write_row(result + i * cols, values.data(), t, row);
          }
        });
        return;
      }
      at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        std::vector<q_t> values(kTileRows * cols);   // one tile's q, row-major
        for (int64_t t = begin; t < end; ++t) {
          untile<kBits>(reinterpret_cast<uint8_t*>(values.data()), weights + t * tile_bytes, cols);
          for (int64_t n = 0; n < kTileRows; ++n) write_row(result + (t * kTileRows + n) * cols, values.data() + n * cols, t, n);
        }
      });
    });
  });
}
