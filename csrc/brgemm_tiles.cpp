// BrgemmTiles (brgemm_tiles.h): tiles of keys and values packed as brgemm reads them, and multiplied.
#include "brgemm_tiles.h"
#include "vectors.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstring>

namespace pagedllm {

namespace {

using bf16 = c10::BFloat16;

// out[i] = (a[i], b[i]) side by side, i < n: the bfloat16 pairs VNNI wants, 16 at a time.
void interleave(const bf16* a, const bf16* b, int64_t n, bf16* out) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vbits16 first, second;
    std::memcpy(&first, a + i, sizeof(first));
    std::memcpy(&second, b + i, sizeof(second));
    const vuint pairs = __builtin_convertvector(first, vuint) | (__builtin_convertvector(second, vuint) << 16);
    std::memcpy(out + 2 * i, &pairs, sizeof(pairs));
  }
  for (; i < n; ++i) {
    out[2 * i] = a[i];
    out[2 * i + 1] = b[i];
  }
}

// out[i] = a[i] as float, i < n.
template <typename cache_t>
void widen_row(const cache_t* a, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) narrow(widen(a + i), out + i);
  for (; i < n; ++i) out[i] = static_cast<float>(a[i]);
}

// Is the brgemm's B operand in VNNI pairs: bfloat16 operands are, float ones are not.
template <typename T>
constexpr bool kPairs = std::is_same_v<T, bf16>;

}  // namespace

template <typename T>
template <typename cache_t>
void BrgemmTiles<T>::pack(const PagedCache<cache_t>& cache, const int64_t* table, int64_t kv_head, int64_t key0,
                          int64_t count, int64_t ld_keys, Operand* keys, Operand* values) {
  static_assert(!kPairs<T> || std::is_same_v<cache_t, bf16>, "bfloat16 tiles are packed from a bfloat16 cache");
  static const cache_t zeros[256] = {};   // the V row past the last key
  const int64_t head_dim = cache.head_dim, block_size = cache.block_size, width = aligned_keys(count);
  constexpr int64_t kStep = kPairs<T> ? 2 : 1;   // rows of K^T (dimensions) and of V (keys) per packed row
  // K^T: a block's keys are stored transposed ([head_dim][block_size]), so each dimension's run of slots is
  // contiguous; bfloat16 puts dimensions 2d and 2d + 1 of each key side by side.
  for (int64_t key = key0; key < key0 + count;) {
    const int64_t slot = key % block_size, run = std::min(block_size - slot, key0 + count - key);
    const cache_t* block = cache.keys(table[key / block_size], kv_head) + slot;
    for (int64_t d = 0; d < head_dim; d += kStep) {
      Operand* out = keys + (d / kStep * ld_keys + key - key0) * kStep;
      if constexpr (kPairs<T>) interleave(block + d * block_size, block + (d + 1) * block_size, run, out);
      else widen_row(block + d * block_size, run, out);
    }
    key += run;
  }
  for (int64_t d = 0; d < head_dim; d += kStep)
    std::fill(keys + (d / kStep * ld_keys + count) * kStep, keys + (d / kStep * ld_keys + width) * kStep, Operand(0));
  // V: bfloat16 puts keys 2j and 2j + 1 side by side; zero rows past the last key.
  auto row = [&](int64_t j) {
    const int64_t key = key0 + j;
    return j < count ? cache.values(table[key / block_size], kv_head) + key % block_size * head_dim : zeros;
  };
  for (int64_t j = 0; j < width; j += kStep) {
    if constexpr (kPairs<T>) interleave(row(j), row(j + 1), head_dim, values + j * head_dim);
    else widen_row(row(j), head_dim, values + j * head_dim);
  }
}

template <typename T>
void BrgemmTiles<T>::score(const Operand* keys, int64_t count, int64_t ld_keys, int64_t head_dim,
                           const Operand* queries, int64_t rows, float* scores, int64_t ld_scores) {
  at::native::cpublas::brgemm(rows, aligned_keys(count), head_dim, head_dim, ld_keys, ld_scores, false, queries, keys,
                              scores, kPairs<T>);
}

template <typename T>
void BrgemmTiles<T>::accumulate(const Operand* values, int64_t count, int64_t head_dim, Operand* probs, int64_t rows,
                                int64_t ld_probs, float* acc) {
  const int64_t width = aligned_keys(count);
  for (int64_t r = 0; r < rows; ++r) std::fill(probs + r * ld_probs + count, probs + r * ld_probs + width, Operand(0));
  at::native::cpublas::brgemm(rows, head_dim, width, ld_probs, head_dim, head_dim, true, probs, values, acc,
                              kPairs<T>);
}

template <typename T>
void BrgemmTiles<T>::release() { at::native::cpublas::brgemm_release(kPairs<T>); }

template struct BrgemmTiles<bf16>;
template struct BrgemmTiles<float>;
template void BrgemmTiles<bf16>::pack(const PagedCache<bf16>&, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                      bf16*, bf16*);
template void BrgemmTiles<float>::pack(const PagedCache<float>&, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                       float*, float*);
template void BrgemmTiles<float>::pack(const PagedCache<bf16>&, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                       float*, float*);

}  // namespace pagedllm
