// The two products of an attention tile (scores = Q K^T, then acc += P V) as small matrix multiplications
// through oneDNN's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm), bfloat16 operands and float
// results: oneDNN generates it for AMX tiles where the CPU has them and for AVX512-BF16 elsewhere. brgemm reads
// its B operand in VNNI pairs ([K / 2][N][2]: rows 2k and 2k + 1 side by side), so each tile's keys and values
// are first packed from the paged blocks (read through the block table, as the register kernels read them)
// into a contiguous buffer, zeros past the tile's last key. A tile's keys are rounded up to kKeyAlign, so a
// walk meets a few distinct matrix shapes (oneDNN generates a kernel per shape and thread, and keeps it).
#pragma once

#include "paged_cache.h"

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace pagedllm {

struct BrgemmTiles {
  using Operand = c10::BFloat16;   // queries and probabilities; the cache must be bfloat16 too
  static constexpr int64_t kKeyAlign = 32;

  static int64_t aligned_keys(int64_t count) { return (count + kKeyAlign - 1) / kKeyAlign * kKeyAlign; }

  // scores [rows][ld_scores] = queries [rows][head_dim] times the keys [key0, key0 + count) of table, columns
  // up to aligned_keys(count) (those past count are 0). packed: scratch for the keys.
  static void score(const PagedCache<Operand>& cache, const int64_t* table, int64_t kv_head, int64_t key0,
                    int64_t count, const Operand* queries, int64_t rows, float* scores, int64_t ld_scores,
                    std::vector<Operand>& packed);

  // acc [rows][head_dim] += probs [rows][ld_probs] times the values of those keys. The probabilities past
  // count, up to aligned_keys(count), are set to 0 first. packed: scratch for the values.
  static void accumulate(const PagedCache<Operand>& cache, const int64_t* table, int64_t kv_head, int64_t key0,
                         int64_t count, Operand* probs, int64_t rows, int64_t ld_probs, float* acc,
                         std::vector<Operand>& packed);

  // Gives back the AMX tile state a thread's brgemm calls took (nothing to do elsewhere).
  static void release();
};

}  // namespace pagedllm
