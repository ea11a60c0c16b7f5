// Vectors of floats for the CPU kernels, as GCC/Clang vector types, one register wide where the build
// has the ISA: 16 lanes with AVX-512, 8 with AVX2 (elsewhere 16, in SSE registers), so one source serves
// every x86 CPU. AVX2 builds take 8 because GCC has no machine mode for a 64-byte vector without AVX-512:
// such vectors lived in stack memory, and their comparisons and selects ran lane by lane in scalar code
// (decode attention read a float32 cache at 5.7 GB/s, prefill attention ran at 15 GFLOP/s on 2 AVX2
// cores; docs/performance.md). Loads widen bfloat16/float16 (and the KV cache's float8 e5m2 and int8) to
// float, stores round back; the arithmetic runs on floats.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedllm {

#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 16;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vbits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint8_t vbits8 __attribute__((vector_size(kLanes * sizeof(uint8_t))));
typedef int16_t vint16 __attribute__((vector_size(kLanes * sizeof(int16_t))));
typedef int8_t vint8 __attribute__((vector_size(kLanes * sizeof(int8_t))));

// The same bits as another type of the same size (an intrinsic's vector as ours).
template <typename To, typename From>
inline To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

template <typename scalar_t>
inline vfloat widen(const scalar_t* src) {   // others: element by element
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(src[i]);
  return v;
}

template <>
inline vfloat widen<float>(const float* src) {
  vfloat v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}

// bfloat16 is the top half of a float: widen the bits and shift them up. With AVX2 / AVX-512 through the
// one-instruction zero extension: GCC's generic conversion widens each half apart and joins them
// (vpmovzxwd twice and an insert), about half of a bfloat16 decode attention's value loop on AVX2.
template <>
inline vfloat widen<c10::BFloat16>(const c10::BFloat16* src) {
#if defined(__AVX512F__)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return bits_as<vfloat>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(__AVX2__)
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return bits_as<vfloat>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  vbits16 bits;
  std::memcpy(&bits, src, sizeof(bits));
  return reinterpret_cast<vfloat>(__builtin_convertvector(bits, vuint) << 16);
#endif
}

// The KV cache's narrow types. GCC's generic code falls short for them: it turns 8-to-32-bit
// vector conversions into scalar code, and float16 has no generic vector conversion. So with
// AVX2 (and F16C, which every AVX2 variant has) or AVX-512 these take the instructions directly:
// measured on decode attention, the int8 cache ran 2.7x slower than bfloat16 through the
// generic code. Elsewhere the generic code serves.

// float16 bits to floats with integer operations: exponent and mantissa move to their float
// places and the exponent is rebiased by 127 - 15; a subnormal (exponent 0) is its mantissa m
// times 2^-24, made as the normal float 0.5 + m 2^-24 minus 0.5 (arithmetic on subnormal floats
// would cost a microcode assist); infinities and NaNs (exponent all ones) get float's all-ones
// exponent. Exact for every input, as vcvtph2ps is.
inline vfloat half_bits_to_float(vuint half) {
  const vuint exponent = half & 0x7c00u, magnitude = (half & 0x7fffu) << 13;
  const vuint normal = magnitude + (112u << 23), special = magnitude | 0x7f800000u;
  const vuint subnormal = reinterpret_cast<vuint>(reinterpret_cast<vfloat>((half & 0x3ffu) | 0x3f000000u) - 0.5f);
  const vuint bits = exponent == 0u ? subnormal : exponent == 0x7c00u ? special : normal;
  return reinterpret_cast<vfloat>(bits | (half & 0x8000u) << 16);
}

inline vfloat halves_to_float(vbits16 half) {
#if defined(__AVX512F__)
  return bits_as<vfloat>(_mm512_cvtph_ps(bits_as<__m256i>(half)));
#elif defined(__F16C__) && defined(__AVX2__)
  return bits_as<vfloat>(_mm256_cvtph_ps(bits_as<__m128i>(half)));
#else
  return half_bits_to_float(__builtin_convertvector(half, vuint));
#endif
}

template <>
inline vfloat widen<c10::Half>(const c10::Half* src) {
  vbits16 bits;
  std::memcpy(&bits, src, sizeof(bits));
  return halves_to_float(bits);
}

// float8 e5m2 is the top byte of a float16.
template <>
inline vfloat widen<c10::Float8_e5m2>(const c10::Float8_e5m2* src) {
#if defined(__AVX512F__)
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return halves_to_float(bits_as<vbits16>(_mm256_slli_epi16(bytes, 8)));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  return halves_to_float(bits_as<vbits16>(_mm_slli_epi16(bytes, 8)));
#else
  vbits8 bits;
  std::memcpy(&bits, src, sizeof(bits));
  return halves_to_float(__builtin_convertvector(bits, vbits16) << 8);
#endif
}

// int8: the quantized value, before its scale (the kernels apply scales per slot, see paged_cache.h).
template <>
inline vfloat widen<int8_t>(const int8_t* src) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return bits_as<vfloat>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  return bits_as<vfloat>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
#else
  vint8 values;   // through 16-bit lanes: the direct conversion would be scalar code
  std::memcpy(&values, src, sizeof(values));
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(values, vint16), vint), vfloat);
#endif
}

// The first n < kLanes elements, the other lanes zero.
template <typename scalar_t>
inline vfloat widen_partial(const scalar_t* src, int64_t n) {
  scalar_t padded[kLanes] = {};
  std::copy(src, src + n, padded);
  return widen(padded);
}

// Every lane x, in one instruction where the ISA has it. (vfloat{} + x makes GCC add x to a zero first, to
// keep -0.0 + 0 = +0: an add before each broadcast in the attention kernels' inner loops; a lane-by-lane
// fill becomes a chain of inserts.)
inline vfloat broadcast(float x) {
#if defined(__AVX512F__)
  return bits_as<vfloat>(_mm512_set1_ps(x));
#elif defined(__AVX2__)
  return bits_as<vfloat>(_mm256_set1_ps(x));
#else
  return vfloat{} + x;
#endif
}

inline float sum_lanes(vfloat v) {
  float total = 0;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// A float vector back to scalar_t, rounding to nearest even.
template <typename scalar_t>
inline void narrow(vfloat v, scalar_t* dst) {   // float16 and others: element by element
  for (int i = 0; i < kLanes; ++i) dst[i] = static_cast<scalar_t>(v[i]);
}

template <>
inline void narrow<float>(vfloat v, float* dst) { std::memcpy(dst, &v, sizeof(v)); }

// v rounded to bfloat16 (nearest even) but kept as floats: the low 16 bits cleared. NaN stays a quiet NaN.
inline vfloat round_to_bf16(vfloat v) {
  const vuint bits = reinterpret_cast<vuint>(v);
  const vuint rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  return v != v ? reinterpret_cast<vfloat>(vuint{} + 0x7fc00000u) : reinterpret_cast<vfloat>(rounded);
}

template <>
inline void narrow<c10::BFloat16>(vfloat v, c10::BFloat16* dst) {
  const vbits16 out = __builtin_convertvector(reinterpret_cast<vuint>(round_to_bf16(v)) >> 16, vbits16);
  std::memcpy(dst, &out, sizeof(out));
}

// v rounded to scalar_t's precision, kept as floats: a formula's mid-way rounding to the
// model dtype without a trip through memory.
template <typename scalar_t>
inline vfloat round_as(vfloat v) {   // float16 and others: through narrow and widen
  scalar_t rounded[kLanes];
  narrow(v, rounded);
  return widen(rounded);
}

template <>
inline vfloat round_as<float>(vfloat v) { return v; }

template <>
inline vfloat round_as<c10::BFloat16>(vfloat v) { return round_to_bf16(v); }

// e^x for x <= 0 (scores minus their maximum): x = n ln2 + r, |r| <= ln2 / 2,
// e^r by Cephes' degree-7 polynomial (relative error ~1e-7), 2^n built in the exponent bits.
inline vfloat exp_nonpositive(vfloat x) {
  x = x < -87.f ? broadcast(-87.f) : x;   // below that 2^n leaves the normal floats
  const vint n = __builtin_convertvector(x * 1.44269504f - 0.5f, vint);   // round half down (x <= 0)
  const vfloat nf = __builtin_convertvector(n, vfloat);
  const vfloat r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vfloat p = broadcast(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * reinterpret_cast<vfloat>((n + 127) << 23);
}

// The largest of s[0..n), n >= 1, a vector at a time (std::max_element runs one compare per element).
inline float max_of(const float* s, int64_t n) {
  vfloat peaks = broadcast(s[0]);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat v = widen(s + i);
    peaks = v > peaks ? v : peaks;
  }
  float peak = peaks[0];
  for (int l = 1; l < kLanes; ++l) peak = std::max(peak, peaks[l]);
  for (; i < n; ++i) peak = std::max(peak, s[i]);
  return peak;
}

// s[i] = e^(s[i] - peak) for i < n, and their sum, kept in a vector: a scalar running sum is one
// dependent add per element (3-4 cycles each), about an eighth of bfloat16 decode attention on AVX2.
inline float exp_in_place(float* s, int64_t n, float peak) {
  vfloat total = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat e = exp_nonpositive(widen(s + i) - peak);
    narrow(e, s + i);
    total += e;
  }
  float sum = sum_lanes(total);
  if (i < n) {   // the tail, padded with the peak (e^0, discarded)
    float tail[kLanes];
    std::fill(tail, tail + kLanes, peak);
    std::copy(s + i, s + n, tail);
    narrow(exp_nonpositive(widen(tail) - peak), tail);
    std::copy(tail, tail + (n - i), s + i);
    for (int64_t t = 0; t < n - i; ++t) sum += tail[t];
  }
  return sum;
}

}  // namespace pagedllm
