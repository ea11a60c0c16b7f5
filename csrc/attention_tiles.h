// Flash-attention tiles over paged K/V for the CPU, shared by prefill_attention.cpp and
// cascade_attention.cpp: a set of query rows (query tokens x the query heads of one kv head)
// walks a range of keys through a block table a tile of blocks at a time, keeping a running
// maximum and sum per row (online softmax), so each K/V element read serves every row. A row
// set's state (accumulated values, maximum, sum) can be stored and folded into another row
// set's: attention over two disjoint key ranges merged through their log-sum-exps.
//
// Dot products take elements two at a time: on CPUs with AVX512-BF16 one vdpbf16ps multiplies
// 16 pairs of bfloat16 and accumulates in float, the pairs interleaved on the fly from the cache
// layout; elsewhere two float FMAs do the same. The cache may hold another dtype than the
// model's (kv_cache_dtype): its elements are widened to float as they are read, and an int8
// cache's per-slot scales multiply the scores and the probabilities instead of each element.
//
// The tile products may instead run as small matrix multiplications through oneDNN's brgemm (BrgemmTiles,
// brgemm_tiles.h: bfloat16 queries and cache, on AMX tiles where the CPU has them; or float queries over a
// float or bfloat16 cache), the tile's K and V packed into the layout it reads; the softmax between them is
// the same.
//
// A row may see a range of keys (a sliding-window layer: its last `window` keys) rather than all before
// it, and scores may be soft-capped (Gemma 2: cap * tanh(score / cap)) before the softmax.
#pragma once

#include "brgemm_tiles.h"
#include "paged_cache.h"
#include "vectors.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace pagedllm {

// Rows that share each loaded pair of K or V vectors (one accumulator register each): TileAttention's
// RowBlock. 8 suits prefill tasks of 24 rows; a decode's few rows (one per query head of a kv head)
// take 4, wasting less on padding rows; the many rows of a shared prefix take 16 where AVX-512's 32
// registers hold them (each load then serves twice the rows; AVX2 has 16 registers of half the width).
constexpr int kRowBlock = 8;
constexpr int kFewRowBlock = 4;
#if defined(__AVX512F__)
constexpr int kManyRowBlock = 16;
#else
constexpr int kManyRowBlock = 8;
#endif
// Keys per tile (whole blocks; one block where blocks are bigger). Big tiles rescale the
// running sums seldom: 24 rows x 512 keys ran at 190-210 GFLOP/s on 300-1200 token
// prompts, 48 x 64 at 140-165 (bf16, 9 heads on 3 kv heads).
constexpr int64_t kTileKeys = 512;

// The keys of a tile over blocks of block_size: whole blocks, one where blocks are bigger.
inline int64_t tile_keys_for(int64_t block_size) { return block_size * std::max<int64_t>(1, kTileKeys / block_size); }

// Generic pairs: two float vectors, two FMAs per pair of elements.
template <typename cache_t>
struct FloatPairs {
  using Operand = float;   // how query rows and probabilities are held
  struct Pair { vfloat first, second; };

  // Elements [0, width) of rows a and b; lanes past width are zero.
  static Pair load(const cache_t* a, const cache_t* b, int64_t width) {
    if (width == kLanes) return {widen(a), widen(b)};
    return {widen_partial(a, width), widen_partial(b, width)};
  }
  // acc + x[0] * pair.first + x[1] * pair.second, lane by lane.
  static vfloat dot(vfloat acc, const Operand* x, const Pair& pair) {
    return acc + x[0] * pair.first + x[1] * pair.second;
  }
};

#if defined(__AVX512BF16__)
// bfloat16 pairs: lane i holds (a[i], b[i]) side by side, as vdpbf16ps wants them.
struct Bf16Pairs {
  using Operand = c10::BFloat16;
  using Pair = __m512bh;

  static Pair load(const c10::BFloat16* a, const c10::BFloat16* b, int64_t width) {
    const __mmask16 mask = width == kLanes ? 0xffff : (1u << width) - 1;
    const __m512i first = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, a));
    const __m512i second = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, b));
    const __m512i interleave = _mm512_set_epi16(
        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    return (Pair)_mm512_permutex2var_epi16(first, interleave, second);
  }
  static vfloat dot(vfloat acc, const Operand* x, Pair pair) {
    int32_t both;
    std::memcpy(&both, x, sizeof(both));
    return (vfloat)_mm512_dpbf16_ps((__m512)acc, (Pair)_mm512_set1_epi32(both), pair);
  }
};
#endif

// bfloat16 pairs only where queries and cache are both bfloat16: a float model's queries and
// probabilities keep their precision over a bfloat16 cache.
template <typename scalar_t, typename cache_t>
struct PairsFor { using type = FloatPairs<cache_t>; };
#if defined(__AVX512BF16__)
template <>
struct PairsFor<c10::BFloat16, c10::BFloat16> { using type = Bf16Pairs; };
#endif

// A key position past every key: a row that sees the whole key range (no causal mask).
constexpr int64_t kSeesAllKeys = std::numeric_limits<int64_t>::max() / 2;

// One query token of a row set: where it is in q and out, and the first and last key positions it may see.
struct QueryToken {
  int64_t token, last_key, first_key = 0;
};

// The first key a query at `position` sees in a layer of sliding window `window` (0: every key).
inline int64_t first_visible_key(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

// Per-thread scratch, reused from row set to row set.
template <typename Operand>
struct TileScratch {
  std::vector<Operand> queries, probs;              // [rows][head_dim], [rows][score_stride]
  std::vector<float> scores, acc, peak, total;      // [rows][score_stride], [rows][head_dim], [rows], [rows]
  std::vector<int64_t> token, last_key, first_key;  // [rows]
  std::vector<const void*> value_rows;              // [tile keys + 1]
  std::vector<float> value_scales;                  // [tile keys]: int8 caches only
};

// The brgemm products' per-thread scratch: its end gives back the AMX tiles the thread's calls took.
template <typename Operand>
struct BrgemmScratch : TileScratch<Operand> {
  ~BrgemmScratch() { BrgemmTiles<Operand>::release(); }
};

// Attention state of rows kept outside a row set, [tokens][heads]: values accumulated against the
// running maximum (acc, head_dim each), the maximum and the sum of exponentials.
struct RowStates {
  float *acc, *peak, *total;
  int64_t num_heads, head_dim;
  int64_t at(int64_t token, int64_t head) const { return token * num_heads + head; }
};

// Pairs: how the tile products run, in registers (FloatPairs, Bf16Pairs: RowBlock rows share each load) or
// through brgemm (BrgemmTiles: RowBlock only pads the rows, to few distinct matrix shapes).
template <typename cache_t, typename Pairs, int RowBlock = kRowBlock>
class TileAttention {
  using Operand = typename Pairs::Operand;
  static constexpr bool kBrgemm = kIsBrgemmTiles<Pairs>;
  using Packed = typename BrgemmTiles<Operand>::Packed;

 public:
  // group: query heads per kv head; num_heads: all of them (out's row width, in heads); softcap: 0 for none.
  TileAttention(const PagedCache<cache_t>& cache, float scale, int64_t group, int64_t num_heads,
                TileScratch<Operand>& s, float softcap = 0)
      : cache_(cache), s_(s), scale_(scale), softcap_(softcap), group_(group), num_heads_(num_heads),
        head_dim_(cache.head_dim),
        tile_keys_(tile_keys_for(cache.block_size)),
        // + kLanes: the softmax reads whole vectors past the last key; brgemm writes up to its aligned count
        score_stride_((kBrgemm ? BrgemmTiles<Operand>::aligned_keys(tile_keys_) : tile_keys_) + kLanes) {}

  // Rows: count query tokens (token_at(i) gives the i-th) times the query heads of kv_head. Row r is
  // token r / group, head kv_head * group + r % group. Rows past the last (to fill the last block of
  // RowBlock) repeat it and are dropped.
  template <typename scalar_t, typename TokenAt>
  void load(const scalar_t* q, int64_t q_token_stride, int64_t kv_head, int64_t count, TokenAt&& token_at) {
    kv_head_ = kv_head;
    rows_ = count * group_;
    padded_rows_ = (rows_ + RowBlock - 1) / RowBlock * RowBlock;
    s_.queries.resize(padded_rows_ * head_dim_);
    s_.scores.resize(padded_rows_ * score_stride_);
    s_.probs.resize(padded_rows_ * score_stride_);
    s_.acc.assign(padded_rows_ * head_dim_, 0.f);
    s_.peak.assign(padded_rows_, -std::numeric_limits<float>::infinity());
    s_.total.assign(padded_rows_, 0.f);
    s_.token.resize(padded_rows_);
    s_.last_key.resize(padded_rows_);
    s_.first_key.resize(padded_rows_);
    s_.value_rows.resize(tile_keys_ + 1);
    if constexpr (kScaled<cache_t>) s_.value_scales.resize(tile_keys_);
    for (int64_t r = 0; r < padded_rows_; ++r) {
      const QueryToken query = token_at(std::min(r, rows_ - 1) / group_);
      const scalar_t* row = q + query.token * q_token_stride + head_of(r) * head_dim_;
      std::transform(row, row + head_dim_, s_.queries.data() + r * head_dim_,
                     [](scalar_t x) { return static_cast<Operand>(x); });
      s_.token[r] = query.token;
      s_.last_key[r] = query.last_key;
      s_.first_key[r] = query.first_key;
    }
  }

  // Attends the rows to keys [key_begin, key_end) of table (each row up to its last_key).
  void walk(const int64_t* table, int64_t key_begin, int64_t key_end) {
    table_ = table;
    walk_tiles(key_begin, key_end);
  }

  // The same over tiles BrgemmTiles::pack packed beforehand, on their grid: keys of the first tile before
  // key_begin are masked as each row's first_key says.
  void walk(const Packed& packed, int64_t key_begin, int64_t key_end) {
    static_assert(kBrgemm, "packed tiles are for the brgemm products");
    packed_ = &packed;
    walk_tiles(key_begin - (key_begin - packed.origin) % tile_keys_, key_end);
  }

  // Writes each row's state to states (its token and head), to be folded into another walk's.
  void save(const RowStates& states) const {
    for (int64_t r = 0; r < rows_; ++r) {
      const int64_t at = states.at(s_.token[r], head_of(r));
      std::copy_n(s_.acc.data() + r * head_dim_, head_dim_, states.acc + at * head_dim_);
      states.peak[at] = s_.peak[r];
      states.total[at] = s_.total[r];
    }
  }

  // Merges the saved state of each row's token and head (attention over other keys) into the row's:
  // both rescaled to the larger maximum, which is the log-sum-exp merge of the two partial softmaxes.
  void fold(const RowStates& states) {
    for (int64_t r = 0; r < rows_; ++r) {
      const int64_t at = states.at(s_.token[r], head_of(r));
      const float other_peak = states.peak[at], peak = std::max(s_.peak[r], other_peak);
      const float mine = std::exp(s_.peak[r] - peak), other = std::exp(other_peak - peak);
      float* acc = s_.acc.data() + r * head_dim_;
      const float* other_acc = states.acc + at * head_dim_;
      for (int64_t c = 0; c < head_dim_; c += kLanes)
        narrow(widen(acc + c) * mine + widen(other_acc + c) * other, acc + c);
      s_.total[r] = s_.total[r] * mine + states.total[at] * other;
      s_.peak[r] = peak;
    }
  }

  // out: [tokens][num_heads][head_dim] in the model dtype; each row's normalised output.
  template <typename scalar_t>
  void store(scalar_t* out) const {
    for (int64_t r = 0; r < rows_; ++r) {
      const float* acc = s_.acc.data() + r * head_dim_;
      scalar_t* row = out + (s_.token[r] * num_heads_ + head_of(r)) * head_dim_;
      const float inv = 1.f / s_.total[r];
      for (int64_t c = 0; c < head_dim_; c += kLanes) narrow(widen(acc + c) * inv, row + c);
    }
  }

 private:
  int64_t head_of(int64_t r) const { return kv_head_ * group_ + std::min(r, rows_ - 1) % group_; }

  void walk_tiles(int64_t key_begin, int64_t key_end) {
    for (int64_t key0 = key_begin; key0 < key_end; key0 += tile_keys_) {
      const int64_t count = std::min(tile_keys_, key_end - key0);
      score(key0, count);
      softmax(key0, count);
      accumulate_values(key0, count);
    }
  }

  // scores[r][j] = q_r . k_(key0 + j), unscaled.
  void score(int64_t key0, int64_t count) {
    if constexpr (kBrgemm) {
      Pairs::score(packed_->keys + packed_->offset(key0), count, packed_->ld_keys, head_dim_, s_.queries.data(),
                   padded_rows_, s_.scores.data(), score_stride_);
    } else {
      score_in_registers(key0, count);
    }
  }

  // acc[r] += sum_j probs[r][j] * v_(key0 + j).
  void accumulate_values(int64_t key0, int64_t count) {
    if constexpr (kBrgemm) {
      Pairs::accumulate(packed_->values + packed_->offset(key0), count, head_dim_, s_.probs.data(), padded_rows_,
                        score_stride_, s_.acc.data());
    } else {
      accumulate_in_registers(key0, count);
    }
  }

  // kLanes keys per vector (a block's keys are stored transposed); int8 keys' scales multiply whole dot products.
  void score_in_registers(int64_t key0, int64_t count) {
    const int64_t block_size = cache_.block_size;
    for (int64_t key = key0; key < key0 + count;) {
      const int64_t slot = key % block_size;
      // Slots [slot, slot + readable) lie in this block; the keys of this walk end at slot + width. Loads take
      // every readable slot: a partial load (copied through the stack) stalls on store forwarding, and the
      // scores of slots past width are never read.
      const int64_t readable = std::min<int64_t>(kLanes, block_size - slot);
      const int64_t width = std::min<int64_t>(readable, key0 + count - key);
      const cache_t* keys = cache_.keys(table_[key / block_size], kv_head_) + slot;
      for (int64_t r0 = 0; r0 < padded_rows_; r0 += RowBlock) {
        vfloat acc[RowBlock] = {};
        for (int64_t d = 0; d < head_dim_; d += 2) {
          const auto pair = Pairs::load(keys + d * block_size, keys + (d + 1) * block_size, readable);
          const Operand* q = s_.queries.data() + r0 * head_dim_ + d;
          for (int64_t r = 0; r < RowBlock; ++r) acc[r] = Pairs::dot(acc[r], q + r * head_dim_, pair);
        }
        if constexpr (kScaled<cache_t>) {
          const float* scales = cache_.key_scales(table_[key / block_size], kv_head_) + slot;
          const vfloat scale = readable == kLanes ? widen(scales) : widen_partial(scales, readable);
          for (int64_t r = 0; r < RowBlock; ++r) acc[r] *= scale;
        }
        // Whole vectors: lanes past width are overwritten by the next keys or never read.
        for (int64_t r = 0; r < RowBlock; ++r)
          std::memcpy(s_.scores.data() + (r0 + r) * score_stride_ + key - key0, &acc[r], sizeof(vfloat));
      }
      key += width;
    }
  }

  // Online softmax: folds this tile's scores into each row's running maximum and sum, rescales
  // the row's accumulated values to the new maximum, and leaves the tile's probabilities.
  void softmax(int64_t key0, int64_t count) {
    vint lane;
    for (int i = 0; i < kLanes; ++i) lane[i] = i;
    const vfloat minus_inf = broadcast(-std::numeric_limits<float>::infinity());
    const float scale = softcap_ > 0 ? 1.f : scale_;   // capped scores are scaled as they are capped
    for (int64_t r = 0; r < padded_rows_; ++r) {
      // Keys [hidden, visible) of the tile: past the row's position (causal) or before its window.
      const int64_t visible = std::clamp<int64_t>(s_.last_key[r] + 1 - key0, 0, count);
      const int64_t hidden = std::clamp<int64_t>(s_.first_key[r] - key0, 0, visible);
      float* scores = s_.scores.data() + r * score_stride_;
      if (softcap_ > 0)
        for (int64_t j = hidden; j < visible; ++j) scores[j] = softcap_ * std::tanh(scores[j] * scale_ / softcap_);
      auto seen = [&](int64_t j) {   // lanes j.. that are keys the row sees
        return lane + static_cast<int32_t>(j) >= static_cast<int32_t>(hidden) &&
               lane + static_cast<int32_t>(j) < static_cast<int32_t>(visible);
      };
      vfloat peak = minus_inf;
      for (int64_t j = hidden / kLanes * kLanes; j < visible; j += kLanes) {
        const vfloat x = widen(scores + j) * scale;
        peak = (seen(j) && x > peak) ? x : peak;
      }
      float new_peak = s_.peak[r];
      for (int i = 0; i < kLanes; ++i) new_peak = std::max(new_peak, peak[i]);
      Operand* probs = s_.probs.data() + r * score_stride_;
      if (new_peak == -std::numeric_limits<float>::infinity()) {   // no key of this tile is visible
        std::fill(probs, probs + count + 1, Operand(0));
        continue;
      }
      vfloat sum{};
      for (int64_t j = 0; j < count + 1; j += kLanes) {   // +1: the odd key's pair partner is zero
        vfloat e = exp_nonpositive(widen(scores + j) * scale - new_peak);
        e = seen(j) ? e : vfloat{};
        sum += e;
        narrow(e, probs + j);
      }
      const float rescale = std::exp(s_.peak[r] - new_peak);   // 0 on the first visible tile
      s_.peak[r] = new_peak;
      s_.total[r] = s_.total[r] * rescale + sum_lanes(sum);
      if (rescale != 1.f) {
        float* acc = s_.acc.data() + r * head_dim_;
        for (int64_t d = 0; d < head_dim_; ++d) acc[d] *= rescale;
      }
    }
  }

  // kLanes dimensions per vector, keys two at a time.
  void accumulate_in_registers(int64_t key0, int64_t count) {
    static const cache_t zeros[256] = {};   // the partner of an odd last key (its probability is 0)
    const int64_t block_size = cache_.block_size;
    const cache_t** rows = reinterpret_cast<const cache_t**>(s_.value_rows.data());
    for (int64_t j = 0; j < count; ++j) {
      const int64_t key = key0 + j;
      rows[j] = cache_.values(table_[key / block_size], kv_head_) + key % block_size * head_dim_;
    }
    rows[count] = zeros;
    if constexpr (kScaled<cache_t>) fold_value_scales(key0, count);
    for (int64_t c = 0; c < head_dim_; c += kLanes) {
      for (int64_t r0 = 0; r0 < padded_rows_; r0 += RowBlock) {
        float* acc_rows = s_.acc.data() + r0 * head_dim_ + c;
        vfloat acc[RowBlock];
        for (int64_t r = 0; r < RowBlock; ++r) acc[r] = widen(acc_rows + r * head_dim_);
        const Operand* probs = s_.probs.data() + r0 * score_stride_;
        for (int64_t j = 0; j < count; j += 2) {
          const auto pair = Pairs::load(rows[j] + c, rows[j + 1] + c, kLanes);
          for (int64_t r = 0; r < RowBlock; ++r) acc[r] = Pairs::dot(acc[r], probs + r * score_stride_ + j, pair);
        }
        for (int64_t r = 0; r < RowBlock; ++r) narrow(acc[r], acc_rows + r * head_dim_);
      }
    }
  }

  // int8 values: probs[r][j] *= scale of key j, as p_j (scale_j v_j) = (p_j scale_j) v_j, so the value
  // loop reads int8 values as they are (one multiply per key and row, not per element).
  void fold_value_scales(int64_t key0, int64_t count) {
    float* scales = s_.value_scales.data();
    for (int64_t j = 0; j < count; ++j) {
      const int64_t key = key0 + j;
      scales[j] = cache_.value_scales(table_[key / cache_.block_size], kv_head_)[key % cache_.block_size];
    }
    for (int64_t r = 0; r < padded_rows_; ++r) {
      float* probs = s_.probs.data() + r * score_stride_;
      for (int64_t j = 0; j < count; ++j) probs[j] *= scales[j];
    }
  }

  const PagedCache<cache_t>& cache_;
  TileScratch<Operand>& s_;
  const float scale_, softcap_;
  const int64_t group_, num_heads_, head_dim_, tile_keys_, score_stride_;
  int64_t kv_head_ = 0, rows_ = 0, padded_rows_ = 0;
  const int64_t* table_ = nullptr;
  const Packed* packed_ = nullptr;
};

// Query positions per task of a chunk: enough rows (positions x group) to reuse each K/V load,
// few enough that the causal triangle wastes little and a chunk splits into many tasks.
constexpr int64_t kTaskRows = 24;

// Query positions [first, first + count) of a chunk (counted from the chunk's start), one kv head;
// keys: those its last position sees (its cost).
struct ChunkTask {
  int64_t chunk, kv_head, first, count, keys;
};

// The tasks of chunks (chunk c: query tokens [starts[c], starts[c + 1]) at positions contexts[c]
// onwards), the costliest first: handed out one at a time, no thread is left with a long one at the end.
// task_rows: the rows (positions x group) a task should hold.
inline std::vector<ChunkTask> chunk_tasks(const int64_t* starts, const int64_t* contexts, int64_t num_chunks,
                                          int64_t group, int64_t num_kv_heads, int64_t task_rows = kTaskRows) {
  const int64_t positions_per_task = std::max<int64_t>(1, task_rows / group);
  std::vector<ChunkTask> tasks;
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int64_t length = starts[chunk + 1] - starts[chunk];
    for (int64_t first = 0; first < length; first += positions_per_task) {
      const int64_t count = std::min(positions_per_task, length - first);
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
        tasks.push_back({chunk, kv_head, first, count, contexts[chunk] + first + count});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const ChunkTask& a, const ChunkTask& b) { return a.keys > b.keys; });
  return tasks;
}

// Runs run(task, scratch) for tasks [0, num_tasks) on torch's threads, handed out one at a time
// (tasks differ in cost), each thread with its own Scratch.
template <typename Scratch, typename F>
void for_each_task(int64_t num_tasks, F&& run) {
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i; (i = next_task.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) run(i, scratch);
  });
}

}  // namespace pagedllm
