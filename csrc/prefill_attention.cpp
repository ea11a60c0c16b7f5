// Paged attention for prefill chunks on the CPU: each query token of a chunk attends to its
// sequence's keys up to its own position, read where they lie in the KV blocks, the cached
// prefix and the chunk's own keys alike (write_kv stores those first). No gather copy.
//
// Tiled like flash attention: a task takes a run of query positions of one chunk and one kv
// head, with all the query heads that share it (its rows: positions x group), walks the keys
// a tile of blocks at a time and keeps a running maximum and sum per row (online softmax),
// so each K/V element read serves every row of the task and scores stay in cache-resident
// scratch. Dot products take elements two at a time: on CPUs with AVX512-BF16 one
// vdpbf16ps multiplies 16 pairs of bfloat16 and accumulates in float, the pairs
// interleaved on the fly from the cache layout; elsewhere two float FMAs do the same.
//
// The cache may hold another dtype than the model's (kv_cache_dtype): its elements are widened
// to float as they are read, and an int8 cache's per-slot scales multiply the scores and the
// probabilities instead of each element. What depends on the model dtype (reading queries,
// writing the output) is kept apart from the key/value walk, which is built once per cache dtype.
#include "ops.h"
#include "paged_cache.h"
#include "vectors.h"

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace pagedllm;

// Rows that share each loaded pair of K or V vectors (one accumulator register each).
constexpr int64_t kRowBlock = 8;
// Query rows per task: enough to reuse each K/V load, few enough that the causal triangle
// wastes little and a chunk splits into many tasks for the threads.
constexpr int64_t kTaskRows = 24;
// Keys per tile (whole blocks; one block where blocks are bigger). Big tiles rescale the
// running sums seldom: 24 rows x 512 keys ran at 190-210 GFLOP/s on 300-1200 token
// prompts, 48 x 64 at 140-165 (bf16, 9 heads on 3 kv heads).
constexpr int64_t kTileKeys = 512;

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

// The shapes of one call, and the raw pointers the tasks read (queries and output apart: their
// dtype is the model's).
template <typename cache_t>
struct Problem : PagedCache<cache_t> {
  int64_t group, num_heads, max_blocks, q_token_stride;
  float scale;
  const int64_t *tables, *query_starts, *context_lens;
};

// Query positions [first, first + count) of a chunk (counted from the chunk's start), one kv head.
struct Task {
  int64_t chunk, kv_head, first, count;
  int64_t keys;   // the task's cost: keys its last position attends to
};

// Per-thread scratch, reused from task to task.
template <typename Operand>
struct Scratch {
  std::vector<Operand> queries, probs;              // [rows][head_dim], [rows][score_stride]
  std::vector<float> scores, acc, peak, total;      // [rows][score_stride], [rows][head_dim], [rows], [rows]
  std::vector<int64_t> last_key;                    // [rows]: the last key position each row sees
  std::vector<const void*> value_rows;              // [tile keys + 1]
  std::vector<float> value_scales;                  // [tile keys]: int8 caches only
};

template <typename cache_t, typename Pairs>
class TaskRunner {
  using Operand = typename Pairs::Operand;

 public:
  TaskRunner(const Problem<cache_t>& p, const Task& task, Scratch<Operand>& s)
      : p_(p), task_(task), s_(s), head_dim_(p.head_dim), rows_(task.count * p.group),
        padded_rows_((rows_ + kRowBlock - 1) / kRowBlock * kRowBlock),
        tile_keys_(p.block_size * std::max<int64_t>(1, kTileKeys / p.block_size)),
        score_stride_(tile_keys_ + kLanes), table_(p.tables + task.chunk * p.max_blocks) {}

  // q, out: the model's queries and output, laid out as prefill_attention takes them.
  template <typename scalar_t>
  void run(const scalar_t* q, scalar_t* out) {
    load_queries(q);
    const int64_t end = p_.context_lens[task_.chunk] + task_.first + task_.count;
    for (int64_t key0 = 0; key0 < end; key0 += tile_keys_) {
      const int64_t count = std::min(tile_keys_, end - key0);
      score(key0, count);
      softmax(key0, count);
      accumulate_values(key0, count);
    }
    store_output(out);
  }

 private:
  // Row r is query position first + r / group of the chunk, query head kv_head * group + r % group.
  // Rows past the task's last (to fill the last block of kRowBlock) repeat it and are dropped.
  int64_t token_of(int64_t r) const {
    return p_.query_starts[task_.chunk] + task_.first + std::min(r, rows_ - 1) / p_.group;
  }
  int64_t head_of(int64_t r) const { return task_.kv_head * p_.group + std::min(r, rows_ - 1) % p_.group; }

  template <typename scalar_t>
  void load_queries(const scalar_t* q_base) {
    s_.queries.resize(padded_rows_ * head_dim_);
    s_.scores.resize(padded_rows_ * score_stride_);
    s_.probs.resize(padded_rows_ * score_stride_);
    s_.acc.assign(padded_rows_ * head_dim_, 0.f);
    s_.peak.assign(padded_rows_, -std::numeric_limits<float>::infinity());
    s_.total.assign(padded_rows_, 0.f);
    s_.last_key.resize(padded_rows_);
    s_.value_rows.resize(tile_keys_ + 1);
    if constexpr (kScaled<cache_t>) s_.value_scales.resize(tile_keys_);
    const int64_t context = p_.context_lens[task_.chunk];
    for (int64_t r = 0; r < padded_rows_; ++r) {
      const scalar_t* q = q_base + token_of(r) * p_.q_token_stride + head_of(r) * head_dim_;
      std::transform(q, q + head_dim_, s_.queries.data() + r * head_dim_,
                     [](scalar_t x) { return static_cast<Operand>(x); });
      s_.last_key[r] = context + task_.first + std::min(r, rows_ - 1) / p_.group;
    }
  }

  // scores[r][j] = q_r . k_(key0 + j), 16 keys per vector (a block's keys are stored transposed);
  // int8 keys' scales multiply whole dot products.
  void score(int64_t key0, int64_t count) {
    const int64_t block_size = p_.block_size;
    for (int64_t key = key0; key < key0 + count;) {
      const int64_t slot = key % block_size;
      const int64_t width = std::min<int64_t>({kLanes, block_size - slot, key0 + count - key});
      const cache_t* keys = p_.keys(table_[key / block_size], task_.kv_head) + slot;
      for (int64_t r0 = 0; r0 < padded_rows_; r0 += kRowBlock) {
        vfloat acc[kRowBlock] = {};
        for (int64_t d = 0; d < head_dim_; d += 2) {
          const auto pair = Pairs::load(keys + d * block_size, keys + (d + 1) * block_size, width);
          const Operand* q = s_.queries.data() + r0 * head_dim_ + d;
          for (int64_t r = 0; r < kRowBlock; ++r) acc[r] = Pairs::dot(acc[r], q + r * head_dim_, pair);
        }
        if constexpr (kScaled<cache_t>) {
          const float* scales = p_.key_scales(table_[key / block_size], task_.kv_head) + slot;
          const vfloat scale = width == kLanes ? widen(scales) : widen_partial(scales, width);
          for (int64_t r = 0; r < kRowBlock; ++r) acc[r] *= scale;
        }
        // Whole vectors: lanes past width are overwritten by the next keys or never read.
        for (int64_t r = 0; r < kRowBlock; ++r)
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
    for (int64_t r = 0; r < padded_rows_; ++r) {
      const int64_t visible = std::clamp<int64_t>(s_.last_key[r] + 1 - key0, 0, count);   // causal
      const float* scores = s_.scores.data() + r * score_stride_;
      vfloat peak = minus_inf;
      for (int64_t j = 0; j < visible; j += kLanes) {
        const vfloat x = widen(scores + j) * p_.scale;
        peak = (lane + static_cast<int32_t>(j) < static_cast<int32_t>(visible) && x > peak) ? x : peak;
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
        vfloat e = exp_nonpositive(widen(scores + j) * p_.scale - new_peak);
        e = lane + static_cast<int32_t>(j) < static_cast<int32_t>(visible) ? e : vfloat{};
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

  // acc[r] += sum_j probs[r][j] * v_(key0 + j), 16 dimensions per vector, keys two at a time.
  void accumulate_values(int64_t key0, int64_t count) {
    static const cache_t zeros[256] = {};   // the partner of an odd last key (its probability is 0)
    const int64_t block_size = p_.block_size;
    const cache_t** rows = reinterpret_cast<const cache_t**>(s_.value_rows.data());
    for (int64_t j = 0; j < count; ++j) {
      const int64_t key = key0 + j;
      rows[j] = p_.values(table_[key / block_size], task_.kv_head) + key % block_size * head_dim_;
    }
    rows[count] = zeros;
    if constexpr (kScaled<cache_t>) fold_value_scales(key0, count);
    for (int64_t c = 0; c < head_dim_; c += kLanes) {
      for (int64_t r0 = 0; r0 < padded_rows_; r0 += kRowBlock) {
        float* acc_rows = s_.acc.data() + r0 * head_dim_ + c;
        vfloat acc[kRowBlock];
        for (int64_t r = 0; r < kRowBlock; ++r) acc[r] = widen(acc_rows + r * head_dim_);
        const Operand* probs = s_.probs.data() + r0 * score_stride_;
        for (int64_t j = 0; j < count; j += 2) {
          const auto pair = Pairs::load(rows[j] + c, rows[j + 1] + c, kLanes);
          for (int64_t r = 0; r < kRowBlock; ++r) acc[r] = Pairs::dot(acc[r], probs + r * score_stride_ + j, pair);
        }
        for (int64_t r = 0; r < kRowBlock; ++r) narrow(acc[r], acc_rows + r * head_dim_);
      }
    }
  }

  // int8 values: probs[r][j] *= scale of key j, as p_j (scale_j v_j) = (p_j scale_j) v_j, so the value
  // loop reads int8 values as they are (one multiply per key and row, not per element).
  void fold_value_scales(int64_t key0, int64_t count) {
    float* scales = s_.value_scales.data();
    for (int64_t j = 0; j < count; ++j) {
      const int64_t key = key0 + j;
      scales[j] = p_.value_scales(table_[key / p_.block_size], task_.kv_head)[key % p_.block_size];
    }
    for (int64_t r = 0; r < padded_rows_; ++r) {
      float* probs = s_.probs.data() + r * score_stride_;
      for (int64_t j = 0; j < count; ++j) probs[j] *= scales[j];
    }
  }

  template <typename scalar_t>
  void store_output(scalar_t* out_base) const {
    for (int64_t r = 0; r < rows_; ++r) {
      const float* acc = s_.acc.data() + r * head_dim_;
      scalar_t* out = out_base + (token_of(r) * p_.num_heads + head_of(r)) * head_dim_;
      const float inv = 1.f / s_.total[r];
      for (int64_t c = 0; c < head_dim_; c += kLanes) narrow(widen(acc + c) * inv, out + c);
    }
  }

  const Problem<cache_t>& p_;
  const Task& task_;
  Scratch<Operand>& s_;
  const int64_t head_dim_, rows_, padded_rows_, tile_keys_, score_stride_;
  const int64_t* table_;
};

template <typename scalar_t, typename cache_t>
void attend(const at::Tensor& out, const at::Tensor& q, const PagedCache<cache_t>& cache,
            const at::Tensor& block_tables, const at::Tensor& query_starts, const at::Tensor& context_lens,
            double scale) {
  using Pairs = typename PairsFor<scalar_t, cache_t>::type;
  const int64_t num_kv_heads = cache.num_kv_heads, group = q.size(1) / num_kv_heads;
  const Problem<cache_t> p{cache, group, q.size(1), block_tables.size(1), q.stride(0), static_cast<float>(scale),
                           block_tables.data_ptr<int64_t>(), query_starts.data_ptr<int64_t>(),
                           context_lens.data_ptr<int64_t>()};
  const scalar_t* queries = q.data_ptr<scalar_t>();
  scalar_t* output = out.data_ptr<scalar_t>();
  const int64_t positions_per_task = std::max<int64_t>(1, kTaskRows / group);
  std::vector<Task> tasks;
  for (int64_t chunk = 0; chunk < context_lens.size(0); ++chunk) {
    const int64_t length = p.query_starts[chunk + 1] - p.query_starts[chunk];
    for (int64_t first = 0; first < length; first += positions_per_task) {
      const int64_t count = std::min(positions_per_task, length - first);
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
        tasks.push_back({chunk, kv_head, first, count, p.context_lens[chunk] + first + count});
    }
  }
  // The costliest first, handed out one at a time: no thread is left with a long task at the end.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.keys > b.keys; });
  std::atomic<int64_t> next_task{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    Scratch<typename Pairs::Operand> scratch;
    for (int64_t i; (i = next_task.fetch_add(1, std::memory_order_relaxed)) < num_tasks;)
      TaskRunner<cache_t, Pairs>(p, tasks[i], scratch).run(queries, output);
  });
}

}  // namespace

void prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, OptionalTensor k_scales,
                       OptionalTensor v_scales, at::Tensor block_tables, at::Tensor query_starts,
                       at::Tensor context_lens, double scale) {
  check_caches(k_cache, v_cache, k_scales, v_scales, "prefill_attention");
  TORCH_CHECK(out.is_contiguous() && block_tables.is_contiguous() && query_starts.is_contiguous() &&
              context_lens.is_contiguous(), "prefill_attention: tensors must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "prefill_attention: each token's heads must be dense");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_starts.scalar_type() == at::kLong &&
              context_lens.scalar_type() == at::kLong, "prefill_attention: index tensors must be int64");
  TORCH_CHECK(query_starts.size(0) == context_lens.size(0) + 1 && block_tables.size(0) == context_lens.size(0),
              "prefill_attention: one block-table row and context length per chunk, chunk starts plus the end");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "prefill_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= 256,
              "prefill_attention: head_dim must be a multiple of 16, at most 256");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    dispatch_cache_type<scalar_t>(k_cache.scalar_type(), "prefill_attention", [&](auto element) {
      using cache_t = decltype(element);
      attend<scalar_t>(out, q, paged_cache<cache_t>(k_cache, v_cache, k_scales, v_scales), block_tables,
                       query_starts, context_lens, scale);
    });
  });
}
