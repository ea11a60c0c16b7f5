// Vectors of 16 floats for the CPU kernels, as GCC/Clang vector types: one AVX-512
// register where the build machine has it (-march=native), two AVX registers or four SSE
// ones elsewhere, so one source serves every x86 CPU. Loads widen bfloat16/float16 (and the
// KV cache's float8 e5m2 and int8) to float, stores round back; the arithmetic runs on floats.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedllm {

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vbits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint8_t vbits8 __attribute__((vector_size(kLanes * sizeof(uint8_t))));
typedef int8_t vint8 __attribute__((vector_size(kLanes * sizeof(int8_t))));

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

// bfloat16 is the top half of a float: widen the bits and shift them up.
template <>
inline vfloat widen<c10::BFloat16>(const c10::BFloat16* src) {
  vbits16 bits;
  std::memcpy(&bits, src, sizeof(bits));
  return reinterpret_cast<vfloat>(__builtin_convertvector(bits, vuint) << 16);
}

// float16 bits, one number per lane, to floats with integer operations and one multiply (any ISA,
// no F16C): exponent and mantissa move to their float places, and the multiply by 2^(127 - 15)
// rebiases the exponent, normalising subnormals on the way; infinities and NaNs (exponent all
// ones) get float's all-ones exponent instead. Exact for every input.
inline vfloat half_bits_to_float(vuint half) {
  const vuint magnitude = (half & 0x7fffu) << 13;
  const vfloat finite = reinterpret_cast<vfloat>(magnitude) * 0x1p112f;
  const vuint special = reinterpret_cast<vuint>(magnitude | 0x7f800000u);
  const vuint bits = (half & 0x7c00u) == 0x7c00u ? special : reinterpret_cast<vuint>(finite);
  return reinterpret_cast<vfloat>(bits | (half & 0x8000u) << 16);
}

template <>
inline vfloat widen<c10::Half>(const c10::Half* src) {
  vbits16 bits;
  std::memcpy(&bits, src, sizeof(bits));
  return half_bits_to_float(__builtin_convertvector(bits, vuint));
}

// float8 e5m2 is the top byte of a float16.
template <>
inline vfloat widen<c10::Float8_e5m2>(const c10::Float8_e5m2* src) {
  vbits8 bits;
  std::memcpy(&bits, src, sizeof(bits));
  return half_bits_to_float(__builtin_convertvector(bits, vuint) << 8);
}

// int8: the quantized value, before its scale (the kernels apply scales per slot, see paged_cache.h).
template <>
inline vfloat widen<int8_t>(const int8_t* src) {
  vint8 values;
  std::memcpy(&values, src, sizeof(values));
  return __builtin_convertvector(values, vfloat);
}

// The first n < kLanes elements, the other lanes zero.
template <typename scalar_t>
inline vfloat widen_partial(const scalar_t* src, int64_t n) {
  scalar_t padded[kLanes] = {};
  std::copy(src, src + n, padded);
  return widen(padded);
}

inline vfloat broadcast(float x) { return vfloat{} + x; }

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

inline void exp_in_place(float* s, int64_t n, float peak) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) narrow(exp_nonpositive(widen(s + i) - peak), s + i);
  if (i < n) {   // the tail, padded with the peak (e^0, discarded)
    float tail[kLanes];
    std::fill(tail, tail + kLanes, peak);
    std::copy(s + i, s + n, tail);
    narrow(exp_nonpositive(widen(tail) - peak), tail);
    std::copy(tail, tail + (n - i), s + i);
  }
}

}  // namespace pagedllm
