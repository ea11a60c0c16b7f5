// BrgemmTiles (brgemm_tiles.h): a tile's keys and values packed into brgemm's VNNI pairs, then multiplied.
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

void BrgemmTiles::score(const PagedCache<Operand>& cache, const int64_t* table, int64_t kv_head, int64_t key0,
                        int64_t count, const Operand* queries, int64_t rows, float* scores, int64_t ld_scores,
                        std::vector<Operand>& packed) {
  // B = K^T [head_dim][keys]: dimensions 2d and 2d + 1 of each key side by side. A block's keys are stored
  // transposed ([head_dim][block_size]), so each dimension's run of slots is contiguous.
  const int64_t head_dim = cache.head_dim, block_size = cache.block_size, keys = aligned_keys(count);
  packed.resize(head_dim * keys);
  Operand* b = packed.data();
  for (int64_t key = key0; key < key0 + count;) {
    const int64_t slot = key % block_size, width = std::min(block_size - slot, key0 + count - key);
    const Operand* block = cache.keys(table[key / block_size], kv_head) + slot;
    for (int64_t d = 0; d < head_dim; d += 2)
      interleave(block + d * block_size, block + (d + 1) * block_size, width, b + (d / 2 * keys + key - key0) * 2);
    key += width;
  }
  for (int64_t d = 0; d < head_dim; d += 2) std::fill(b + (d / 2 * keys + count) * 2, b + (d / 2 + 1) * keys * 2, Operand(0));
  at::native::cpublas::brgemm(rows, keys, head_dim, head_dim, keys, ld_scores, false, queries, b, scores, true);
}

void BrgemmTiles::accumulate(const PagedCache<Operand>& cache, const int64_t* table, int64_t kv_head, int64_t key0,
                             int64_t count, Operand* probs, int64_t rows, int64_t ld_probs, float* acc,
                             std::vector<Operand>& packed) {
  // B = V [keys][head_dim]: keys 2j and 2j + 1 side by side, a zero row past the last key.
  static const Operand zeros[256] = {};
  const int64_t head_dim = cache.head_dim, block_size = cache.block_size, keys = aligned_keys(count);
  packed.resize(keys * head_dim);
  auto row = [&](int64_t j) {
    const int64_t key = key0 + j;
    return j < count ? cache.values(table[key / block_size], kv_head) + key % block_size * head_dim : zeros;
  };
  for (int64_t j = 0; j < keys; j += 2) interleave(row(j), row(j + 1), head_dim, packed.data() + j * head_dim);
  for (int64_t r = 0; r < rows; ++r) std::fill(probs + r * ld_probs + count, probs + r * ld_probs + keys, Operand(0));
  at::native::cpublas::brgemm(rows, head_dim, keys, ld_probs, head_dim, head_dim, true, probs, packed.data(), acc,
                              true);
}

void BrgemmTiles::release() { at::native::cpublas::brgemm_release(true); }

}  // namespace pagedllm
