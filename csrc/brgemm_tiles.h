// The two products of an attention tile (scores = Q K^T, then acc += P V) as small matrix multiplications
// through oneDNN's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm), float results. Operands are
// bfloat16 (oneDNN generates AMX tiles where the CPU has them, AVX512-BF16 elsewhere; B read in VNNI pairs,
// [K / 2][N][2]: rows 2k and 2k + 1 side by side) or float (a float model's queries, over a float or bfloat16
// cache, widened as packed; AVX-512 or AVX2 FMAs). A sequence's keys and values are first packed, tile by
// tile, from the paged blocks (read through the block table) into a contiguous buffer, zeros past a tile's last
// key; every task of the sequence then reads the packed tiles (packing per task instead cost a fifth of the
// kernel's time, and would cost more where AMX makes the products fast).
// A tile's keys are rounded up to kKeyAlign, so a walk meets few distinct matrix shapes (oneDNN generates a
// kernel per shape and thread, and keeps it).
#pragma once

#include "paged_cache.h"

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

namespace pagedllm {

template <typename T>
struct BrgemmTiles {
  using Operand = T;   // queries, probabilities and packed K/V: bfloat16 (the cache must be too) or float
  static constexpr int64_t kKeyAlign = 32;

  static int64_t aligned_keys(int64_t count) { return (count + kKeyAlign - 1) / kKeyAlign * kKeyAlign; }

  // One kv head's packed keys and values of one sequence: tile t holds keys origin + t * tile_keys onwards,
  // its K at keys + t * tile_elements (rows of ld_keys = aligned_keys(tile_keys) columns, whatever the tile's
  // count), its V at values + t * tile_elements.
  struct Packed {
    const Operand *keys, *values;
    int64_t origin, tile_keys, ld_keys, tile_elements;

    int64_t offset(int64_t key0) const { return (key0 - origin) / tile_keys * tile_elements; }
  };

  // Keys [key0, key0 + count) of table's kv_head (one tile) as brgemm reads them: K^T into keys (bfloat16:
  // [head_dim / 2][ld_keys][2]; float: [head_dim][ld_keys]; columns count to aligned_keys(count) zero), V into
  // values (bfloat16: [aligned_keys(count) / 2][head_dim][2]; float: [aligned_keys(count)][head_dim]; rows
  // past count zero).
  template <typename cache_t>
  static void pack(const PagedCache<cache_t>& cache, const int64_t* table, int64_t kv_head, int64_t key0,
                   int64_t count, int64_t ld_keys, Operand* keys, Operand* values);

  // scores [rows][ld_scores] = queries [rows][head_dim] times the first count keys of a packed tile (columns
  // up to aligned_keys(count); past the keys packed, 0).
  static void score(const Operand* keys, int64_t count, int64_t ld_keys, int64_t head_dim, const Operand* queries,
                    int64_t rows, float* scores, int64_t ld_scores);

  // acc [rows][head_dim] += probs [rows][ld_probs] times the first count values of a packed tile. The
  // probabilities past count, up to aligned_keys(count), are set to 0 first.
  static void accumulate(const Operand* values, int64_t count, int64_t head_dim, Operand* probs, int64_t rows,
                         int64_t ld_probs, float* acc);

  // Gives back the AMX tile state a thread's brgemm calls took (nothing to do elsewhere).
  static void release();
};

template <typename Pairs>
inline constexpr bool kIsBrgemmTiles = false;
template <typename T>
inline constexpr bool kIsBrgemmTiles<BrgemmTiles<T>> = true;

}  // namespace pagedllm
