// The default quantized matmuls: float (or bfloat16) activations against the weights of quant_format.h,
// dequantized on the fly (W4A16 / W8A16), so only the weights' own rounding separates them from the float
// path. int8 activations (quant_linear.cpp) are an opt-in speed mode: their rounding flipped answers.
//
// quantized_linear_rows, for few rows (decode): llama.cpp's order. Per group (32 columns; 16 for Q6_K) the raw q
// values times x are summed (each 32-bit lane of a slot is one weight row, so 16 rows come out per load with shifts,
// no shuffles), then scale * sum + min * sum(x) is added once per group and output, each row's sum(x) per group
// computed once per call: one multiply-add per weight instead of two. With 16 lanes a nibble becomes its float
// by a table lookup (vpermps); with AVX512-BF16 and bfloat16 activations, 4-bit q values (exact in bfloat16)
// meet pairs of activations in vdpbf16ps, two weights per lane and instruction. Up to 8 activation rows (2 on
// AVX2) meet a tile's q values together. Each output's sums run in one order over the columns, whatever the rows or
// tiles it was computed with: a row's result does not depend on the batch it shares.
//
// quantized_linear_brgemm, for many rows (prefill, large batches): blocks of 64 weight rows are
// dequantized into a bfloat16 (VNNI pairs) or float buffer that stays in cache while every activation
// row meets it through oneDNN's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm), which
// oneDNN generates for AMX where the CPU has it and for AVX-512 (BF16) or AVX2 (float) elsewhere.
// Past the rows that stay in cache (a long prefill), the whole weight is dequantized first and each
// thread's chunk of rows meets every block, so the activations are read from memory once, not per block.
// bfloat16 activations may come back as float32 sums (out float32: the LM head's logits): bfloat16 products are
// exact in float32 and brgemm accumulates in float32, so only the weights' rounding to bfloat16 is added, at
// twice float32's rate.
#include "kept_scratch.h"
#include "ops.h"
#include "quant_format.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pagedllm::check_matmul;
using pagedllm::dispatch_format;
using pagedllm::KeptScratch;
using pagedllm::scale_type_of;
using pagedllm::kTileRows;

// Weight rows per vector: a whole tile on AVX-512, half of one elsewhere (the register file of AVX2
// holds 8 rows' accumulators of 8 lanes, not of 16).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kParts = kTileRows / kLanes;
// Activation rows that meet a tile's q values together: as many as keep every accumulator in a register (AVX2's
// 16 registers hold 2 rows' worth; 8 rows there spilled and took 4.7x 4 rows' time, measured on the LM head).
constexpr int kRowBlock = kLanes == 16 ? 8 : 2;
constexpr int64_t kChunkTiles = 4;   // tiles met by every row block in turn
typedef float wfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t wuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t wint __attribute__((vector_size(kLanes * sizeof(int32_t))));

template <typename T>
inline T load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kLanes consecutive scales or mins as floats.
inline wfloat load_params(const float* p) { return load<wfloat>(p); }
inline wfloat load_params(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  wfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return load<wfloat>(&v);
}

// Lanes below 2^31 as floats, converted as signed integers: without AVX-512 there is no unsigned conversion
// instruction, and the compiler's unsigned one takes six (which made the AVX2 rows kernel compute-bound).
inline wfloat small_to_float(wuint v) { return __builtin_convertvector(reinterpret_cast<wint>(v), wfloat); }

// The dequantized weights of 8 consecutive columns c0..c0+7 (c0 a multiple of 8, one group), rows
// part * kLanes onwards of the tile: w[c] lane n = scale * q + min of (row, c0 + c).
template <int bits>
inline void dequantize_8_columns(wfloat (&w)[8], const uint8_t* tile, int64_t c0, int part, wfloat scale,
                                 wfloat min) {
  const int64_t lanes_at = part * kLanes * 4;
  if constexpr (bits == 4) {   // the pair of slots c0 / 4 and c0 / 4 + 1 shares 64 bytes: low and high nibbles
    const wuint packed = load<wuint>(tile + (c0 / 8) * 64 + lanes_at);
    const wuint low = packed & 0x0F0F0F0Fu, high = (packed >> 4) & 0x0F0F0F0Fu;
    for (int c = 0; c < 4; ++c) {
      w[c] = small_to_float((low >> (8 * c)) & 0xFFu) * scale + min;
      w[c + 4] = small_to_float((high >> (8 * c)) & 0xFFu) * scale + min;
    }
  } else {   // signed bytes: shifted to the top of the lane, then arithmetically back down
    for (int half = 0; half < 2; ++half) {
      const wint slot = load<wint>(tile + (c0 / 4 + half) * 64 + lanes_at);
      for (int c = 0; c < 4; ++c) w[4 * half + c] = __builtin_convertvector((slot << (24 - 8 * c)) >> 24, wfloat) * scale + min;
    }
  }
}

struct Weights {   // one quantized weight's tensors, as the kernels read them
  const uint8_t* q;
  int64_t tile_bytes, params_per_tile, cols, group;
};

// What the rows kernel reads of the activations, prepared once per call: x as floats, each row's sum over
// each group's columns (the min's factor), and, for the bfloat16 dot-product path, x as bfloat16 pairs.
struct Activations {
  const float* x = nullptr;          // [rows, cols], the float path's
  const float* sums = nullptr;       // [rows, groups]: x summed over each group's columns in order
  const uint32_t* pairs = nullptr;   // [rows, cols / 2]: the bfloat16 path's (see bf16_pairs)
  int64_t cols = 0, groups = 0;
};

// The raw q values of 8 consecutive columns c0..c0+7 (c0 a multiple of 8) as floats, rows part * kLanes
// onwards of the tile: q[c] lane n = q of (row, c0 + c). 4 bits: nibble k of a 32-bit lane is column
// c0 + k / 2 + 4 (k % 2) (byte k / 2's low nibble is slot c0 / 4, its high one slot c0 / 4 + 1); with 16
// lanes a permute looks each nibble up in a table of the floats 0..15 (vpermps reads an index's low 4 bits),
// elsewhere it is masked and converted.
template <int bits>
inline void q_values_8_columns(wfloat (&q)[8], const uint8_t* tile, int64_t c0, int part) {
  const int64_t lanes_at = part * kLanes * 4;
  if constexpr (bits == 4) {
    const wuint packed = load<wuint>(tile + (c0 / 8) * 64 + lanes_at);
#if defined(__AVX512F__)
    static_assert(kLanes == 16);
    const __m512 floats = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i index = load<__m512i>(&packed);
    for (int k = 0; k < 8; ++k) {
      const __m512 values = _mm512_permutexvar_ps(_mm512_srli_epi32(index, 4 * k), floats);
      q[k / 2 + 4 * (k % 2)] = load<wfloat>(&values);
    }
#else
    for (int k = 0; k < 8; ++k) q[k / 2 + 4 * (k % 2)] = small_to_float((packed >> (4 * k)) & 0x0Fu);
#endif
  } else {   // signed bytes: shifted to the top of the lane, then arithmetically back down
    for (int half = 0; half < 2; ++half) {
      const wint slot = load<wint>(tile + (c0 / 4 + half) * 64 + lanes_at);
      for (int c = 0; c < 4; ++c) q[4 * half + c] = __builtin_convertvector((slot << (24 - 8 * c)) >> 24, wfloat);
    }
  }
}

// Software prefetch of the weights: one row's pass over kTiles tiles reads kTiles interleaved streams, which
// the hardware prefetchers keep too few reads in flight for (11-14 GB/s of 32+ from memory). Tiles are
// contiguous, so while a pass reads bytes at offset o of tile t, the same offset of tile t + kTiles (the next
// pass's) is requested: the whole stream a prefetch distance of kTiles tiles (18 KB for the 576-column
// projections) ahead, each line once. Prefetches never fault, so the last pass's (past the weight) are harmless.
inline void prefetch_line(const void* p, int64_t ahead_bytes) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + ahead_bytes), 0, 3);
}

// The lines of `tile` a pass reads at columns c0..c0+7, kTiles tiles ahead.
template <int bits, int kTiles>
inline void prefetch_ahead(const uint8_t* tile, const Weights& weights, int64_t c0) {
  const int64_t ahead = kTiles * weights.tile_bytes;
  if constexpr (bits == 4) {   // one 64-byte line of each tile per 8 columns
    prefetch_line(tile + (c0 / 8) * 64, ahead);
  } else {   // two slots, two lines
    prefetch_line(tile + (c0 / 4) * 64, ahead);
    prefetch_line(tile + (c0 / 4 + 1) * 64, ahead);
  }
}

// Partial sums per group and output: independent chains, so one row's few outputs keep the FMA units busy. AVX2
// takes 4 and one tile at a time (2 chains over 2 tiles left the FMAs waiting on spilled accumulators: 1.4x the
// time of 4 chains over one on the LM head, measured); AVX-512 takes 2 over up to 4 tiles (row_block).
constexpr int kChains = kLanes == 16 ? 2 : 4;

// acc += scale * (sum of q x over the group) + min * (sum of x over the group), once per group and output,
// in this order for every output (whatever rows or tiles share the call: batch invariance).
template <typename scale_t, int kRows, int kTiles>
inline void close_group(wfloat (&acc)[kTiles][kRows], const wfloat (&sum)[kTiles][kRows][kChains],
                        const Activations& x, const Weights& weights, const scale_t* scales, const scale_t* mins,
                        int64_t first_tile, int64_t g, int part) {
  for (int t = 0; t < kTiles; ++t) {
    const int64_t at = (first_tile + t) * weights.params_per_tile + g * kTileRows + part * kLanes;
    const int64_t params_ahead = kTiles * weights.params_per_tile * static_cast<int64_t>(sizeof(scale_t));
    prefetch_line(scales + at, params_ahead);   // the next pass's, as prefetch_ahead does the weights
    if (mins != nullptr) prefetch_line(mins + at, params_ahead);
    const wfloat scale = load_params(scales + at);
    const wfloat min = mins != nullptr ? load_params(mins + at) : wfloat{};
    for (int r = 0; r < kRows; ++r) {
      if (mins != nullptr) acc[t][r] = acc[t][r] + min * x.sums[r * x.groups + g];
      wfloat total = sum[t][r][0];
      for (int k = 1; k < kChains; ++k) total += sum[t][r][k];
      acc[t][r] = acc[t][r] + scale * total;
    }
  }
}

template <int kRows, int kTiles>
inline void store_accumulators(float* out, int64_t ld_out, const wfloat (&acc)[kTiles][kRows], int part) {
  for (int t = 0; t < kTiles; ++t) {
    for (int r = 0; r < kRows; ++r) std::memcpy(out + r * ld_out + t * kTileRows + part * kLanes, &acc[t][r], sizeof(wfloat));
  }
}

// out[r][t * 16 + n] = sum over columns of x[r][c] * w[t][n][c] for kRows activation rows and kTiles tiles
// from `first_tile` (out's row stride ld_out), in llama.cpp's order: per group the raw q values times x
// summed, then scaled once (close_group). Float activations.
template <int bits, typename scale_t, int kRows, int kTiles>
void rows_times_tiles(float* out, int64_t ld_out, const Activations& x, const Weights& weights, const scale_t* scales,
                      const scale_t* mins, int64_t first_tile) {
  const int64_t cols = weights.cols, group = weights.group;
  for (int part = 0; part < kParts; ++part) {
    wfloat acc[kTiles][kRows] = {};
    for (int64_t g = 0; g < cols / group; ++g) {
      wfloat sum[kTiles][kRows][kChains] = {};
      for (int64_t c0 = g * group; c0 < (g + 1) * group; c0 += 8) {
        for (int t = 0; t < kTiles; ++t) {
          wfloat q[8];
          const uint8_t* tile = weights.q + (first_tile + t) * weights.tile_bytes;
          // Part 0 only: a second part re-reads the lines the first one brought into cache. (Tested here rather
          // than by an early return inside: GCC then dropped the prefetches of every part in the AVX2 build.)
          if (part == 0) prefetch_ahead<bits, kTiles>(tile, weights, c0);
          q_values_8_columns<bits>(q, tile, c0, part);
          // Unrolled by pragma: left to itself GCC keeps both loops from 5 rows on, and sum's chain index
          // c % kChains, no longer a constant, puts every accumulator on the stack (5.6x 4 rows' time, measured).
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 8
            for (int r = 0; r < kRows; ++r) sum[t][r][c % kChains] += q[c] * x.x[r * cols + c0 + c];
          }
        }
      }
      close_group(acc, sum, x, weights, scales, mins, first_tile, g, part);
    }
    store_accumulators(out, ld_out, acc, part);
  }
}

#if defined(__AVX512BF16__)
// The bfloat16 path (4 bits, bfloat16 activations, AVX512-BF16): q values 0..15 are exact in bfloat16, and
// vdpbf16ps multiplies two of them per 32-bit lane by a pair of activations (exact products, float sums).
// A 16-bit shift of a lane by 4 s (s = 0..3) leaves in the low bits of its two halves the nibbles of columns
// c0 + s / 2 + 4 (s % 2) (low half) and that + 2 (high half); vpermw looks each up in a 32-entry table of
// bfloat16 (entry i is i & 15: it reads an index's low 5 bits). bf16_pairs lays the activations out to match.
constexpr int64_t pair_column(int64_t c0, int s) { return c0 + s / 2 + 4 * (s % 2); }

template <typename scale_t, int kRows, int kTiles>
void rows_times_tiles_bf16(float* out, int64_t ld_out, const Activations& x, const Weights& weights,
                           const scale_t* scales, const scale_t* mins, int64_t first_tile) {
  static_assert(kParts == 1);
  const int64_t cols = weights.cols, group = weights.group;
  alignas(64) uint16_t entries[32];
  for (int i = 0; i < 32; ++i) entries[i] = static_cast<uint16_t>(c10::BFloat16(static_cast<float>(i & 15)).x);
  const __m512i table = _mm512_load_si512(entries);
  wfloat acc[kTiles][kRows] = {};
  for (int64_t g = 0; g < cols / group; ++g) {
    __m512 sum[kTiles][kRows][kChains];
    for (auto& tile_sums : sum) for (auto& row_sums : tile_sums) for (auto& chain : row_sums) chain = _mm512_setzero_ps();
    for (int64_t c0 = g * group; c0 < (g + 1) * group; c0 += 8) {
      for (int t = 0; t < kTiles; ++t) {
        const uint8_t* tile = weights.q + (first_tile + t) * weights.tile_bytes;
        prefetch_ahead<4, kTiles>(tile, weights, c0);
        const __m512i packed = _mm512_loadu_si512(tile + (c0 / 8) * 64);
        for (int s = 0; s < 4; ++s) {
          const __m512bh q = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(packed, 4 * s), table);
          for (int r = 0; r < kRows; ++r) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(x.pairs[r * (cols / 2) + c0 / 2 + s]));
            sum[t][r][s % kChains] = _mm512_dpbf16_ps(sum[t][r][s % kChains], q, pair);
          }
        }
      }
    }
    wfloat sums[kTiles][kRows][kChains];
    std::memcpy(&sums, &sum, sizeof(sums));
    close_group(acc, sums, x, weights, scales, mins, first_tile, g, 0);
  }
  store_accumulators(out, ld_out, acc, 0);
}
#endif

// `rows` (<= kRowBlock) activation rows against `tiles` tiles: the tiles in groups as wide as the
// registers allow for that many rows (one row alone would leave the FMA units waiting on one chain), the
// tiles left over in groups half as wide, and so on. kBf16: the bfloat16 dot-product path.
template <bool kBf16, int bits, typename scale_t, int kRows, int kTiles>
void tiles_in_groups(float* out, int64_t ld_out, const Activations& x, const Weights& weights, const scale_t* scales,
                     const scale_t* mins, int64_t first_tile, int64_t tiles) {
  int64_t t = 0;
  for (; t + kTiles <= tiles; t += kTiles) {
#if defined(__AVX512BF16__)
    if constexpr (kBf16) {
      rows_times_tiles_bf16<scale_t, kRows, kTiles>(out + t * kTileRows, ld_out, x, weights, scales, mins, first_tile + t);
      continue;
    }
#endif
    rows_times_tiles<bits, scale_t, kRows, kTiles>(out + t * kTileRows, ld_out, x, weights, scales, mins, first_tile + t);
  }
  if constexpr (kTiles > 1) {
    tiles_in_groups<kBf16, bits, scale_t, kRows, kTiles / 2>(out + t * kTileRows, ld_out, x, weights, scales, mins,
                                                             first_tile + t, tiles - t);
  }
}

template <bool kBf16, int bits, typename scale_t, int kRows>
void row_block(float* out, int64_t ld_out, const Activations& x, const Weights& weights, const scale_t* scales,
               const scale_t* mins, int64_t first_tile, int64_t tiles) {
  constexpr int kTiles = (kRows >= 4 || kLanes == 8) ? 1 : kRows == 1 ? 4 : 2;
  tiles_in_groups<kBf16, bits, scale_t, kRows, kTiles>(out, ld_out, x, weights, scales, mins, first_tile, tiles);
}

template <bool kBf16, int bits, typename scale_t, int... kRows>
void any_row_block(int rows, float* out, int64_t ld_out, const Activations& x, const Weights& weights,
                   const scale_t* scales, const scale_t* mins, int64_t first_tile, int64_t tiles,
                   std::integer_sequence<int, kRows...>) {
  ((rows == kRows + 1 ? row_block<kBf16, bits, scale_t, kRows + 1>(out, ld_out, x, weights, scales, mins, first_tile, tiles)
                      : void()), ...);
}

// The float results of a block of rows x columns written out, bias added, in the output dtype.
template <typename scalar_t>
void store(scalar_t* out, int64_t ld_out, const float* block, int64_t ld_block, int64_t rows, int64_t cols,
           const scalar_t* bias) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t n = 0; n < cols; ++n) {
      const float value = block[r * ld_block + n] + (bias != nullptr ? static_cast<float>(bias[n]) : 0.f);
      out[r * ld_out + n] = static_cast<scalar_t>(value);
    }
  }
}

// x as floats (a copy unless it is float already). Widened here rather than by x.to(kFloat): a decode step
// makes ~120 of these 1-row calls, and ATen's copy (dispatch, allocation) cost more than the widening itself.
template <typename scalar_t>
const float* as_floats(const at::Tensor& x, std::vector<float>& holder) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x.data_ptr<float>();
  } else {
    const scalar_t* values = x.data_ptr<scalar_t>();
    holder.resize(x.numel());
    at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) holder[i] = static_cast<float>(values[i]);
    });
    return holder.data();
  }
}

// Each row's sum over each group's columns, in column order: [rows, cols / group] (cols a multiple of group).
template <typename scalar_t>
std::vector<float> group_sums(const at::Tensor& x, int64_t group) {
  const scalar_t* values = x.data_ptr<scalar_t>();
  std::vector<float> sums(x.numel() / group);
  at::parallel_for(0, static_cast<int64_t>(sums.size()), 1 << 12, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float total = 0;
      for (int64_t c = 0; c < group; ++c) total += static_cast<float>(values[i * group + c]);
      sums[i] = total;
    }
  });
  return sums;
}

#if defined(__AVX512BF16__)
// bfloat16 activations [rows, cols] as the pairs rows_times_tiles_bf16 multiplies: per 8 columns from c0,
// pair s holds column pair_column(c0, s) in its low half and that column + 2 in its high half.
std::vector<uint32_t> bf16_pairs(const at::Tensor& x) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  std::vector<uint32_t> pairs(x.numel() / 2);
  for (int64_t c0 = 0; c0 < x.numel(); c0 += 8) {   // rows are whole 8-column blocks (cols % 32 == 0)
    for (int s = 0; s < 4; ++s) {
      const int64_t c = pair_column(c0, s);
      pairs[c0 / 2 + s] = bits[c] | (static_cast<uint32_t>(bits[c + 2]) << 16);
    }
  }
  return pairs;
}
#endif

// The activations from row r on.
Activations rows_from(const Activations& x, int64_t r) {
  Activations from = x;
  if (x.x != nullptr) from.x += r * x.cols;
  if (x.pairs != nullptr) from.pairs += r * x.cols / 2;
  from.sums += r * x.groups;
  return from;
}

Weights weights_of(const at::Tensor& qweight, const at::Tensor& scales, int64_t cols, int64_t group) {
  return {static_cast<const uint8_t*>(qweight.data_ptr()), qweight.size(1), scales.size(1), cols, group};
}

// One block of tiles dequantized for brgemm's B [cols, tiles * 16]: bfloat16 in VNNI pairs ([cols / 2,
// width, 2]: columns 2k and 2k + 1 of a weight row side by side), float plainly ([cols, width]).
template <int bits, typename scale_t, typename scalar_t>
void dequantize_block(scalar_t* b, const Weights& weights, const scale_t* scales, const scale_t* mins,
                      int64_t first_tile, int64_t tiles) {
  const int64_t width = tiles * kTileRows;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tile = weights.q + (first_tile + t) * weights.tile_bytes;
    for (int part = 0; part < kParts; ++part) {
      const int64_t n0 = t * kTileRows + part * kLanes;
      for (int64_t g = 0; g < weights.cols / weights.group; ++g) {
        const int64_t at = (first_tile + t) * weights.params_per_tile + g * kTileRows + part * kLanes;
        const wfloat scale = load_params(scales + at), min = mins != nullptr ? load_params(mins + at) : wfloat{};
        for (int64_t c0 = g * weights.group; c0 < (g + 1) * weights.group; c0 += 8) {
          wfloat w[8];
          dequantize_8_columns<bits>(w, tile, c0, part, scale, min);
          for (int c = 0; c < 8; c += 2) {
            if constexpr (std::is_same_v<scalar_t, float>) {
              std::memcpy(b + (c0 + c) * width + n0, &w[c], sizeof(wfloat));
              std::memcpy(b + (c0 + c + 1) * width + n0, &w[c + 1], sizeof(wfloat));
            } else {   // round to nearest even, keep the top halves: one 32-bit lane per weight row holds the pair
              auto bf16_bits = [](wfloat v) {
                const wuint u = load<wuint>(&v);
                return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
              };
              const wuint pairs = bf16_bits(w[c]) | (bf16_bits(w[c + 1]) << 16);
              std::memcpy(b + ((c0 + c) / 2 * width + n0) * 2, &pairs, sizeof(pairs));
            }
          }
        }
      }
    }
  }
}

// brgemm's N and M. 64 weight rows a block (4 accumulators wide, as oneDNN's own bfloat16 matmul blocks N) and
// up to 256 activation rows a call: against 32 x 64 they cut a 2,048-row prefill's layers from 42.5 to 36.1 ms
// (the float layer: 35.5 ms; docs/quantized_matmul.md), the per-call cost of at::native::cpublas::brgemm (its
// kernel looked up by shape) and the re-reads of each activation row per 32 outputs being what the larger blocks save.
// float32 without AVX-512 takes 32 weight rows a block (4 AVX2 registers wide): over the bundled model's four layer
// shapes, 2,048 rows 97.5 -> 87.0 ms and 128 rows 7.7 -> 5.3 ms on 2 AVX2 cores (docs/quantized_matmul.md).
template <typename scalar_t>
constexpr int64_t block_tiles() {
#if defined(__AVX512F__)
  return 4;
#else
  return std::is_same_v<scalar_t, float> ? 2 : 4;
#endif
}
constexpr int64_t kBlockRows = 256;
constexpr int64_t kCacheBytes = 512 * 1024;   // activations a thread keeps in cache (half a 1-2 MiB L2)

// Activation rows that fit kCacheBytes, in whole brgemm calls (so the row blocks are those of one pass over all rows).
int64_t cache_rows(int64_t row_bytes) {
  return std::max<int64_t>(1, kCacheBytes / row_bytes / kBlockRows) * kBlockRows;
}

}  // namespace

namespace {

// quantized_linear_rows's work on tiles [first_tile_of_call, last_tile_of_call): split(first, last, f) runs f over
// runs of those tiles, on the cores (at::parallel_for) or on the calling thread alone (a share).
template <typename Split>
void rows_matmul(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias, int64_t bits,
                 int64_t group, int64_t first_tile_of_call, int64_t last_tile_of_call, Split&& split) {
  const int64_t rows = x.size(0), cols = x.size(1), out_features = out.size(1);
  const Weights weights = weights_of(qweight, scales, cols, group);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantized_linear_rows", [&] {
    scalar_t* result = out.data_ptr<scalar_t>();
    const scalar_t* bias_values = bias ? bias->data_ptr<scalar_t>() : nullptr;
    const std::vector<float> sums = group_sums<scalar_t>(x, group);
    dispatch_format(bits, scales, mins, [&](auto bits_constant, auto all_scales, auto all_mins) {
      constexpr int kBits = decltype(bits_constant)::value;
      using scale_t = scale_type_of<decltype(all_scales)>;
#if defined(__AVX512BF16__)
      constexpr bool kBf16 = kBits == 4 && std::is_same_v<scalar_t, c10::BFloat16>;
#else
      constexpr bool kBf16 = false;
#endif
      Activations activations;
      activations.sums = sums.data();
      activations.cols = cols;
      activations.groups = cols / group;
      std::vector<float> floats;
      std::vector<uint32_t> pairs;
#if defined(__AVX512BF16__)
      if constexpr (kBf16) {
        pairs = bf16_pairs(x);
        activations.pairs = pairs.data();
      }
#endif
      if constexpr (!kBf16) activations.x = as_floats<scalar_t>(x, floats);
      // Each thread an equal run of tiles (a decode step's 36-tile layers split 18/18, not 20/16 as chunks of
      // 4 did), walked kChunkTiles at a time: a chunk's weights stay in cache while every row block meets them.
      split(first_tile_of_call, last_tile_of_call, [&](int64_t begin, int64_t end) {
        std::vector<float> block(kRowBlock * kChunkTiles * kTileRows);
        const int64_t ld_block = kChunkTiles * kTileRows;
        for (int64_t first_tile = begin; first_tile < end; first_tile += kChunkTiles) {
          const int64_t num_tiles = std::min(kChunkTiles, end - first_tile);
          const int64_t first_out = first_tile * kTileRows;
          const int64_t valid = std::min(num_tiles * kTileRows, out_features - first_out);
          for (int64_t r = 0; r < rows; r += kRowBlock) {
            const int block_rows = static_cast<int>(std::min<int64_t>(kRowBlock, rows - r));
            any_row_block<kBf16, kBits, scale_t>(block_rows, block.data(), ld_block, rows_from(activations, r),
                                                 weights, all_scales, all_mins, first_tile, num_tiles,
                                                 std::make_integer_sequence<int, kRowBlock>{});
            store(result + r * out_features + first_out, out_features, block.data(), ld_block, block_rows, valid,
                  bias_values ? bias_values + first_out : nullptr);
          }
        }
      });
    });
  });
}

}  // namespace

void quantized_linear_rows(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                           c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group) {
  RECORD_FUNCTION("pagedllm::quantized_linear_rows", std::vector<c10::IValue>({x, qweight}));   // torch.profiler names it
  check_matmul(out, x, qweight, scales, mins, bias, bits, group, "quantized_linear_rows");
  rows_matmul(out, x, qweight, scales, mins, bias, bits, group, 0, qweight.size(0),
              [](int64_t first, int64_t last, const auto& f) { at::parallel_for(first, last, 1, f); });
}

void quantized_linear_rows_share(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                                 const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                 const c10::optional<at::Tensor>& bias, int64_t bits, int64_t group,
                                 int64_t first_tile, int64_t last_tile) {
  check_matmul(out, x, qweight, scales, mins, bias, bits, group, "quantized_linear_rows_share");
  TORCH_CHECK(0 <= first_tile && first_tile <= last_tile && last_tile <= qweight.size(0),
              "quantized_linear_rows_share: tiles must be a range within 0..", qweight.size(0));
  if (first_tile == last_tile) return;
  rows_matmul(out, x, qweight, scales, mins, bias, bits, group, first_tile, last_tile,
              [](int64_t first, int64_t last, const auto& f) { f(first, last); });
}

void quantized_linear_brgemm(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                             c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group) {
  RECORD_FUNCTION("pagedllm::quantized_linear_brgemm", std::vector<c10::IValue>({x, qweight}));   // torch.profiler names it
  check_matmul(out, x, qweight, scales, mins, bias, bits, group, "quantized_linear_brgemm", /*float_out_allowed=*/true);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "quantized_linear_brgemm: x must be bfloat16 or float32, got ", x.scalar_type());
  const int64_t rows = x.size(0), cols = x.size(1), out_features = out.size(1), tiles = qweight.size(0);
  const Weights weights = weights_of(qweight, scales, cols, group);
  // scalar_t: x's and the dequantized weights' dtype; out_t: the output's and bias's (float32 for bfloat16 x
  // where the caller wants brgemm's float sums unrounded: the LM head's logits).
  auto run = [&](auto dtype, auto out_dtype) {
    using scalar_t = decltype(dtype);
    using out_t = decltype(out_dtype);
    constexpr bool kVnni = std::is_same_v<scalar_t, c10::BFloat16>;   // float B is plain, bfloat16 B in pairs
    constexpr int64_t kBlockTiles = block_tiles<scalar_t>();
    const scalar_t* activations = x.data_ptr<scalar_t>();
    out_t* result = out.data_ptr<out_t>();
    const out_t* bias_values = bias ? bias->data_ptr<out_t>() : nullptr;
    dispatch_format(bits, scales, mins, [&](auto bits_constant, auto all_scales, auto all_mins) {
      constexpr int kBits = decltype(bits_constant)::value;
      using scale_t = scale_type_of<decltype(all_scales)>;
      const int64_t num_blocks = (tiles + kBlockTiles - 1) / kBlockTiles;
      // Block nb of weight rows: its tiles, its brgemm N, its first output and the outputs that exist.
      auto block_shape = [&](int64_t nb) {
        const int64_t first_tile = nb * kBlockTiles, num_tiles = std::min(kBlockTiles, tiles - first_tile);
        const int64_t width = num_tiles * kTileRows, first_out = first_tile * kTileRows;
        return std::array<int64_t, 4>{first_tile, num_tiles, width, std::min(width, out_features - first_out)};
      };
      // Activation rows [first, last) against block nb's dequantized weights b, kBlockRows rows per brgemm call.
      auto multiply = [&](const scalar_t* b, int64_t nb, int64_t first, int64_t last, float* c) {
        const auto [first_tile, num_tiles, width, valid] = block_shape(nb);
        for (int64_t r = first; r < last; r += kBlockRows) {
          const int64_t block_rows = std::min(kBlockRows, last - r);
          at::native::cpublas::brgemm(block_rows, width, cols, cols, width, width, false, activations + r * cols,
                                      b, c, kVnni);
          store(result + r * out_features + first_tile * kTileRows, out_features, c, width, block_rows, valid,
                bias_values ? bias_values + first_tile * kTileRows : nullptr);
        }
      };
      const int64_t fits = cache_rows(cols * static_cast<int64_t>(sizeof(scalar_t)));
      if (rows <= fits) {   // the activations stay in cache: each block dequantized, then met by every row
        at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
          const KeptScratch<scalar_t, 0> b(cols * kBlockTiles * kTileRows);
          const KeptScratch<float, 1> c(kBlockRows * kBlockTiles * kTileRows);
          for (int64_t nb = begin; nb < end; ++nb) {
            const auto [first_tile, num_tiles, width, valid] = block_shape(nb);
            dequantize_block<kBits, scale_t, scalar_t>(b.data(), weights, all_scales, all_mins, first_tile, num_tiles);
            multiply(b.data(), nb, 0, rows, c.data());
          }
          at::native::cpublas::brgemm_release(kVnni);
        });
        return;
      }
      // Too many rows to stay in cache: streaming them from memory once per block would bound the matmul by
      // memory, so the whole weight is dequantized once and each chunk of rows (kept in cache) meets every block.
      const int64_t threads = at::get_num_threads();
      const int64_t share = ((rows + threads - 1) / threads + kBlockRows - 1) / kBlockRows * kBlockRows;
      const int64_t chunk_rows = std::min(fits, share);   // at least one chunk per thread
      const int64_t block_size = cols * kBlockTiles * kTileRows;
      const KeptScratch<scalar_t, 2> all_blocks(num_blocks * block_size);
      at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t nb = begin; nb < end; ++nb) {
          const auto [first_tile, num_tiles, width, valid] = block_shape(nb);
          dequantize_block<kBits, scale_t, scalar_t>(all_blocks.data() + nb * block_size, weights, all_scales,
                                                     all_mins, first_tile, num_tiles);
        }
      });
      at::parallel_for(0, (rows + chunk_rows - 1) / chunk_rows, 1, [&](int64_t begin, int64_t end) {
        const KeptScratch<float, 1> c(kBlockRows * kBlockTiles * kTileRows);
        for (int64_t chunk = begin; chunk < end; ++chunk) {
          for (int64_t nb = 0; nb < num_blocks; ++nb) {
            multiply(all_blocks.data() + nb * block_size, nb, chunk * chunk_rows,
                     std::min(rows, (chunk + 1) * chunk_rows), c.data());
          }
        }
        at::native::cpublas::brgemm_release(kVnni);
      });
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{}, float{});
  } else if (out.scalar_type() == at::kFloat) {
    run(c10::BFloat16{}, float{});
  } else {
    run(c10::BFloat16{}, c10::BFloat16{});
  }
}
