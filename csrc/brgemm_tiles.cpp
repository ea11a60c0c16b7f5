// BrgemmTiles (brgemm_tiles.h): tiles of keys and values packed into brgemm's VNNI pairs, and multiplied.
#include "brgemm_tiles.h"
#include "vectors.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstring>

namespace pagedllm {

namespace {

// out[i] = (a[i], b[i]) side by side, i < n: the bfloat16 pairs VNNI wants, 16 at a time.
void interleave(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n, c10::BFloat16* out) {
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

}  // namespace

void BrgemmTiles::pack(const PagedCache<Operand>& cache, const int64_t* table, int64_t kv_head, int64_t key0,
                       int64_t count, int64_t ld_keys, Operand* keys, Operand* values) {
  static const Operand zeros[256] = {};   // the V row past the last key
  const int64_t head_dim = cache.head_dim, block_size = cache.block_size, width = aligned_keys(count);
  // K^T: dimensions 2d and 2d + 1 of each key side by side. A block's keys are stored transposed
  // ([head_dim][block_size]), so each dimension's run of slots is contiguous.
  for (int64_t key = key0; key < key0 + count;) {
    const int64_t slot = key % block_size, run = std::min(block_size - slot, key0 + count - key);
    const Operand* block = cache.keys(table[key / block_size], kv_head) + slot;
    for (int64_t d = 0; d < head_dim; d += 2)
      interleave(block + d * block_size, block + (d + 1) * block_size, run, keys + (d / 2 * ld_keys + key - key0) * 2);
    key += run;
  }
  for (int64_t d = 0; d < head_dim; d += 2)
    std::fill(keys + (d / 2 * ld_keys + count) * 2, keys + (d / 2 * ld_keys + width) * 2, Operand(0));
  // V: keys 2j and 2j + 1 side by side, zero rows past the last key.
  auto row = [&](int64_t j) {
    const int64_t key = key0 + j;
    return j < count ? cache.values(table[key / block_size], kv_head) + key % block_size * head_dim : zeros;
  };
  for (int64_t j = 0; j < width; j += 2) interleave(row(j), row(j + 1), head_dim, values + j * head_dim);
}

void BrgemmTiles::score(const Operand* keys, int64_t count, int64_t ld_keys, int64_t head_dim, const Operand* queries,
                        int64_t rows, float* scores, int64_t ld_scores) {
  at::native::cpublas::brgemm(rows, aligned_keys(count), head_dim, head_dim, ld_keys, ld_scores, false, queries, keys,
                              scores, true);
}

void BrgemmTiles::accumulate(const Operand* values, int64_t count, int64_t head_dim, Operand* probs, int64_t rows,
                             int64_t ld_probs, float* acc) {
  const int64_t width = aligned_keys(count);
  for (int64_t r = 0; r < rows; ++r) std::fill(probs + r * ld_probs + count, probs + r * ld_probs + width, Operand(0));
  at::native::cpublas::brgemm(rows, head_dim, width, ld_probs, head_dim, head_dim, true, probs, values, acc, true);
}

void BrgemmTiles::release() { at::native::cpublas::brgemm_release(true); }

}  // namespace pagedllm
