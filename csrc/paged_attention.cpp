// Paged attention for the CPU: each query token attends to its sequence's keys and
// values where they lie, in KV blocks reached through the block table. No gather copy,
// no padding to the longest sequence. Used for decode tokens (prefill chunks have
// csrc/prefill_attention.cpp, which shares each K/V read among many queries). A decode
// step reads every cached K/V row once, so the kernel should run at memory speed: rows
// are widened to floats a vector (vectors.h's kLanes) at a time and the softmax's exp is a vector polynomial,
// not a libm call per score. A smaller KV cache dtype (kv_cache_dtype) means fewer bytes per
// step: its elements are widened the same way, int8 ones with their per-slot scales applied to
// the scores and probabilities they produce. A sliding-window layer's token reads only its last
// `window` keys' blocks; soft-capped scores (Gemma 2) go through cap * tanh(score / cap) first.
#include "ops.h"
#include "paged_cache.h"
#include "vectors.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <vector>

namespace {

using namespace pagedllm;

// The shapes of one call, and the raw pointers the tasks read: queries and output in the
// model's scalar_t, the caches in cache_t.
template <typename scalar_t, typename cache_t>
struct Problem : PagedCache<cache_t> {
  int64_t group, max_blocks, q_token_stride, window;   // window 0: every key
  float scale, softcap;                                 // softcap 0: none
  const scalar_t* q;
  scalar_t* out;
  const int64_t *tables, *rows, *lens;
};

// Asks for a block (all kv heads' parts, side by side) while earlier ones are computed:
// blocks lie anywhere in the cache, so the hardware prefetcher cannot guess where the next is.
template <typename cache_t>
inline void prefetch(const cache_t* block, int64_t elements) {
  constexpr int64_t kLine = 64 / sizeof(cache_t);
  for (int64_t i = 0; i < elements; i += kLine) __builtin_prefetch(block + i);
}

constexpr int64_t kPrefetchAhead = 2;   // blocks; 1 to 8 measured alike

// Scratch space one thread reuses from token to token.
struct Scratch {
  std::vector<float> query, scores, acc;   // [heads][head_dim], [heads][padded_len], [heads][head_dim]
  std::vector<float> inverse_totals;        // [heads]: 1 / the sum of each head's unnormalised probabilities
};

// Query heads per tile: each keeps two accumulator registers (two vectors of slots or dimensions, or even and
// odd ones), 16 of AVX-512's 32 registers at 8 heads, 8 of AVX2's 16 at 4.
#if defined(__AVX512F__)
constexpr int64_t kHeadTile = 8;
#else
constexpr int64_t kHeadTile = 4;
#endif

// Calls f(std::integral_constant<int, Heads>{}, first) for the query heads [0, group) in tiles of up to kHeadTile.
template <typename F>
void for_head_tiles(int64_t group, F&& f) {
  for (int64_t first = 0; first < group;) {
    const int64_t tile = std::min<int64_t>(kHeadTile, group - first);
    switch (tile) {
      case 1: f(std::integral_constant<int, 1>{}, first); break;
      case 2: f(std::integral_constant<int, 2>{}, first); break;
      case 3: f(std::integral_constant<int, 3>{}, first); break;
      case 4: f(std::integral_constant<int, 4>{}, first); break;
      case 5: f(std::integral_constant<int, 5>{}, first); break;
      case 6: f(std::integral_constant<int, 6>{}, first); break;
      case 7: f(std::integral_constant<int, 7>{}, first); break;
      default: f(std::integral_constant<int, 8>{}, first); break;
    }
    first += tile;
  }
}

// low[h] += x[h][i] * rows[i][0, kLanes) and high[h] += x[h][i] * rows[i][kLanes, 2 kLanes) for i < n, rows
// row_stride elements apart: each broadcast element of x feeds two vectors, and each head keeps two
// dependency chains. The inner loop of both the scores (rows: a key dimension's slots, x: the queries) and the
// values (rows: a slot's dimensions, x: the probabilities).
template <typename cache_t, int Heads>
inline void accumulate_two_vectors(const cache_t* rows, int64_t row_stride, int64_t n, const float* x,
                                   int64_t x_stride, vfloat (&low)[Heads], vfloat (&high)[Heads]) {
  for (int64_t i = 0; i < n; ++i) {
    const cache_t* row = rows + i * row_stride;
    const vfloat v0 = widen(row), v1 = widen(row + kLanes);
    for (int h = 0; h < Heads; ++h) {
      const vfloat b = broadcast(x[h * x_stride + i]);
      low[h] += b * v0;
      high[h] += b * v1;
    }
  }
}

// The scores of kLanes slots (or the first `width` of them) for one head, int8 keys' scales applied: a
// slot's scale multiplies its whole dot product, once per kLanes slots rather than once per element.
template <typename cache_t>
inline void store_scores(vfloat v, const float* key_scales, int64_t slot, int64_t width, float* scores) {
  if constexpr (kScaled<cache_t>)
    v *= width == kLanes ? widen(key_scales + slot) : widen_partial(key_scales + slot, width);
  if (width == kLanes) narrow(v, scores + slot);
  else std::memcpy(scores + slot, &v, width * sizeof(float));
}

// Scores of one kv head's part of a block for `Heads` query heads: keys are stored transposed, so kLanes
// slots come out of plain vector FMAs (one query element times kLanes keys) with no horizontal sums. Each
// head keeps two dependency chains: where the block holds two vectors of slots (AVX2's 8 lanes, blocks of
// 16) they share each broadcast query element; otherwise even and odd dimensions accumulate apart.
// (One vector per broadcast made broadcasts three loads in four on AVX2; docs/performance.md, "Then decode
// attention".)
template <typename cache_t, int Heads>
inline void score_block(const cache_t* keys, const float* key_scales, int64_t head_dim, int64_t block_size,
                        const float* query, float* scores, int64_t score_stride) {
  const int64_t pairs_end = block_size / (2 * kLanes) * (2 * kLanes);
  for (int64_t slot = 0; slot < pairs_end; slot += 2 * kLanes) {
    vfloat low[Heads] = {}, high[Heads] = {};
    accumulate_two_vectors<cache_t, Heads>(keys + slot, block_size, head_dim, query, head_dim, low, high);
    for (int h = 0; h < Heads; ++h) {
      store_scores<cache_t>(low[h], key_scales, slot, kLanes, scores + h * score_stride);
      store_scores<cache_t>(high[h], key_scales, slot + kLanes, kLanes, scores + h * score_stride);
    }
  }
  for (int64_t slot = pairs_end; slot < block_size; slot += kLanes) {
    const int64_t width = std::min<int64_t>(kLanes, block_size - slot);   // < kLanes in small blocks only
    vfloat even[Heads] = {}, odd[Heads] = {};
    for (int64_t d = 0; d < head_dim; d += 2) {
      const cache_t* row = keys + d * block_size + slot;
      const vfloat k0 = width == kLanes ? widen(row) : widen_partial(row, width);
      const vfloat k1 = width == kLanes ? widen(row + block_size) : widen_partial(row + block_size, width);
      for (int h = 0; h < Heads; ++h) {
        even[h] += query[h * head_dim + d] * k0;
        odd[h] += query[h * head_dim + d + 1] * k1;
      }
    }
    for (int h = 0; h < Heads; ++h) store_scores<cache_t>(even[h] + odd[h], key_scales, slot, width,
                                                          scores + h * score_stride);
  }
}

// acc[h] += sum_j probs[h][j] * value_j over the first n slots of one kv head's part of a block; values are
// rows, so kLanes dimensions accumulate per instruction. Two dependency chains per head, as for the scores:
// two vectors of dimensions sharing each broadcast probability where head_dim holds them, else even and odd
// slots apart. int8 values come with their scales folded into probs (scale_probs).
template <typename cache_t, int Heads>
inline void accumulate_block(const cache_t* values, int64_t head_dim, int64_t n, const float* probs,
                             int64_t prob_stride, float* acc) {
  const int64_t pairs_end = head_dim / (2 * kLanes) * (2 * kLanes);
  for (int64_t c = 0; c < pairs_end; c += 2 * kLanes) {
    vfloat low[Heads], high[Heads];
    for (int h = 0; h < Heads; ++h) {
      low[h] = widen(acc + h * head_dim + c);
      high[h] = widen(acc + h * head_dim + c + kLanes);
    }
    accumulate_two_vectors<cache_t, Heads>(values + c, head_dim, n, probs, prob_stride, low, high);
    for (int h = 0; h < Heads; ++h) {
      narrow(low[h], acc + h * head_dim + c);
      narrow(high[h], acc + h * head_dim + c + kLanes);
    }
  }
  for (int64_t c = pairs_end; c < head_dim; c += kLanes) {
    vfloat even[Heads], odd[Heads] = {};
    for (int h = 0; h < Heads; ++h) even[h] = widen(acc + h * head_dim + c);
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
      const vfloat v0 = widen(values + j * head_dim + c), v1 = widen(values + (j + 1) * head_dim + c);
      for (int h = 0; h < Heads; ++h) {
        even[h] += probs[h * prob_stride + j] * v0;
        odd[h] += probs[h * prob_stride + j + 1] * v1;
      }
    }
    if (j < n) {
      const vfloat v0 = widen(values + j * head_dim + c);
      for (int h = 0; h < Heads; ++h) even[h] += probs[h * prob_stride + j] * v0;
    }
    for (int h = 0; h < Heads; ++h) narrow(even[h] + odd[h], acc + h * head_dim + c);
  }
}

// probs[h][j] *= scales[j] for `heads` rows of probabilities, slots j < n: p_j (scale_j v_j) is
// (p_j scale_j) v_j, so the value loop reads int8 values as they are, one multiply per slot and head.
inline void scale_probs(float* probs, int64_t prob_stride, int64_t heads, const float* scales, int64_t n) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < n; ++j) probs[h * prob_stride + j] *= scales[j];
}

// The blocks a token's keys lie in: from the block of the first key in the window (the first key without one),
// kv_len slots from that block's start, in num_blocks table entries from `table`.
struct Walk {
  int64_t first_key, kv_len, num_blocks;
  const int64_t* table;
};

template <typename scalar_t, typename cache_t>
Walk walk_of(const Problem<scalar_t, cache_t>& p, int64_t token) {
  const int64_t all_keys = p.lens[token];
  const int64_t first_key = p.window > 0 ? std::max<int64_t>(0, all_keys - p.window) : 0;
  const int64_t first_block = first_key / p.block_size, kv_len = all_keys - first_block * p.block_size;
  return {first_key, kv_len, (kv_len + p.block_size - 1) / p.block_size,
          p.tables + p.rows[token] * p.max_blocks + first_block};
}

// One query token, all heads. Blocks are walked in table order with every kv head's part
// of a block taken together: a block's parts lie side by side, so reads run through whole
// blocks, and through runs of blocks where the pool handed a sequence neighbouring ones (a
// prompt's blocks come out of the free queue together). Measured on 64 sequences x 400
// tokens x 30 layers: blocks in order 60 -> 28 ms against one kv head at a time, blocks in
// random order 70 -> 80 ms; the shared workload's decode attention 15.3 -> 10.1 s.
// Keys first, then the softmax (its division applied to the output), then the values. Only kv heads
// [kv_first, kv_end) and their query heads: a step of fewer tokens than threads shares a token's kv heads
// out (each head's result is the same either way).
template <typename scalar_t, typename cache_t>
void attend_token(const Problem<scalar_t, cache_t>& p, int64_t token, int64_t kv_first, int64_t kv_end,
                  Scratch& scratch) {
  const int64_t head_dim = p.head_dim, block_size = p.block_size, group = p.group;
  const int64_t num_heads = p.num_kv_heads * group, block_elements = p.num_kv_heads * head_dim * block_size;
  // The walk starts at the block of the first key in the window (the first key without one); slots
  // before that key in its block (skipped) and past the last key get no probability.
  const Walk walk = walk_of(p, token);
  const int64_t first_key = walk.first_key, skipped = first_key % block_size, kv_len = walk.kv_len;
  const int64_t num_blocks = walk.num_blocks, padded_len = num_blocks * block_size;   // scores past kv_len dropped
  const int64_t* table = walk.table;

  const scalar_t* q = p.q + token * p.q_token_stride;
  scratch.query.resize(num_heads * head_dim);
  for (int64_t i = 0; i < num_heads * head_dim; ++i) scratch.query[i] = static_cast<float>(q[i]) * p.scale;
  scratch.scores.resize(num_heads * padded_len);
  scratch.acc.assign(num_heads * head_dim, 0.f);
  scratch.inverse_totals.resize(num_heads);
  float *query = scratch.query.data(), *scores = scratch.scores.data(), *acc = scratch.acc.data();
  float* inverse_totals = scratch.inverse_totals.data();

  // Block i of the walk is the K of table[i] for i < num_blocks, then the V of table[i - num_blocks]
  // (with its scales, for int8).
  const int64_t scale_elements = p.num_kv_heads * block_size;
  const int64_t part_elements = (kv_end - kv_first) * head_dim * block_size;   // these kv heads' parts of a block
  auto prefetch_block = [&](int64_t i) {
    if (i >= 2 * num_blocks) return;
    const bool keys = i < num_blocks;
    const int64_t block = table[keys ? i : i - num_blocks];
    prefetch((keys ? p.k_cache : p.v_cache) + block * block_elements + kv_first * head_dim * block_size,
             part_elements);
    if constexpr (kScaled<cache_t>)
      prefetch((keys ? p.k_scales : p.v_scales) + block * scale_elements + kv_first * block_size,
               (kv_end - kv_first) * block_size);
  };
  for (int64_t i = 0; i < kPrefetchAhead; ++i) prefetch_block(i);

  for (int64_t b = 0; b < num_blocks; ++b) {
    prefetch_block(b + kPrefetchAhead);
    for (int64_t kv_head = kv_first; kv_head < kv_end; ++kv_head) {
      const cache_t* keys = p.keys(table[b], kv_head);
      const float* key_scales = kScaled<cache_t> ? p.key_scales(table[b], kv_head) : nullptr;
      for_head_tiles(group, [&](auto heads, int64_t first) {
        constexpr int kHeads = decltype(heads)::value;
        const int64_t head = kv_head * group + first;
        score_block<cache_t, kHeads>(keys, key_scales, head_dim, block_size, query + head * head_dim,
                                     scores + head * padded_len + b * block_size, padded_len);
      });
    }
  }

  for (int64_t h = kv_first * group; h < kv_end * group; ++h) {
    float* s = scores + h * padded_len;
    if (p.softcap > 0)
      for (int64_t t = skipped; t < kv_len; ++t) s[t] = p.softcap * std::tanh(s[t] / p.softcap);
    const float peak = max_of(s + skipped, kv_len - skipped);
    inverse_totals[h] = 1.f / exp_in_place(s + skipped, kv_len - skipped, peak);
    std::fill(s, s + skipped, 0.f);
  }

  for (int64_t b = 0; b < num_blocks; ++b) {
    prefetch_block(num_blocks + b + kPrefetchAhead);
    const int64_t n = std::min(block_size, kv_len - b * block_size);
    for (int64_t kv_head = kv_first; kv_head < kv_end; ++kv_head) {
      const cache_t* values = p.values(table[b], kv_head);
      if constexpr (kScaled<cache_t>)
        scale_probs(scores + kv_head * group * padded_len + b * block_size, padded_len, group,
                    p.value_scales(table[b], kv_head), n);
      for_head_tiles(group, [&](auto heads, int64_t first) {
        constexpr int kHeads = decltype(heads)::value;
        const int64_t head = kv_head * group + first;
        accumulate_block<cache_t, kHeads>(values, head_dim, n, scores + head * padded_len + b * block_size,
                                           padded_len, acc + head * head_dim);
      });
    }
  }

  scalar_t* out = p.out + token * num_heads * head_dim;   // the softmax's division, once per output element
  for (int64_t h = kv_first * group; h < kv_end * group; ++h)
    for (int64_t i = h * head_dim; i < (h + 1) * head_dim; i += kLanes)
      narrow(widen(acc + i) * inverse_totals[h], out + i);
}

template <typename scalar_t, typename cache_t>
Problem<scalar_t, cache_t> problem_of(const at::Tensor& out, const at::Tensor& q, const PagedCache<cache_t>& cache,
                                      const at::Tensor& block_tables, const at::Tensor& token_rows,
                                      const at::Tensor& kv_lens, double scale, int64_t window, double softcap) {
  return {cache, q.size(1) / cache.num_kv_heads, block_tables.size(1), q.stride(0), window, static_cast<float>(scale),
          static_cast<float>(softcap), q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
          block_tables.data_ptr<int64_t>(), token_rows.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>()};
}

template <typename scalar_t, typename cache_t>
void attend(const Problem<scalar_t, cache_t>& p, int64_t num_tokens) {
  // Tokens are handed out one at a time: sequences differ in length, so equal shares of
  // tokens would leave one thread idle while another finishes long ones. With fewer than two tokens per
  // thread each kv head of a token is a task of its own (batch-1 decode ran on one thread of two).
  const int64_t threads = at::get_num_threads();
  const int64_t parts = num_tokens < 2 * threads ? p.num_kv_heads : 1;   // tasks per token
  const int64_t tasks = num_tokens * parts, heads_per_part = p.num_kv_heads / parts;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(threads, tasks), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t task; (task = next_task.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t kv_first = task % parts * heads_per_part;
      attend_token(p, task / parts, kv_first, kv_first + heads_per_part, scratch);
    }
  });
}

// The checks both entry points make, then f(problem, number of tokens) with the problem in its C++ types.
template <typename F>
void with_problem(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const OptionalTensor& k_scales, const OptionalTensor& v_scales, const at::Tensor& block_tables,
                  const at::Tensor& token_rows, const at::Tensor& kv_lens, double scale, int64_t sliding_window,
                  double logit_softcap, const char* op, F&& f) {
  check_caches(k_cache, v_cache, k_scales, v_scales, op);
  TORCH_CHECK(out.is_contiguous() && block_tables.is_contiguous() && token_rows.is_contiguous() &&
              kv_lens.is_contiguous(), op, ": tensors must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), op, ": each token's heads must be dense");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && token_rows.scalar_type() == at::kLong &&
              kv_lens.scalar_type() == at::kLong, op, ": index tensors must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, op, ": heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= 256, op, ": head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0, op, ": sliding_window and logit_softcap must be "
              ">= 0 (0: none)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    dispatch_cache_type<scalar_t>(k_cache.scalar_type(), op, [&](auto element) {
      using cache_t = decltype(element);
      f(problem_of<scalar_t>(out, q, paged_cache<cache_t>(k_cache, v_cache, k_scales, v_scales), block_tables,
                             token_rows, kv_lens, scale, sliding_window, logit_softcap),
        q.size(0));
    });
  });
}

}  // namespace

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, OptionalTensor k_scales,
                     OptionalTensor v_scales, at::Tensor block_tables, at::Tensor token_rows, at::Tensor kv_lens,
                     double scale, int64_t sliding_window, double logit_softcap) {
  RECORD_FUNCTION("pagedllm::paged_attention", std::vector<c10::IValue>({out}));   // torch.profiler names it
  with_problem(out, q, k_cache, v_cache, k_scales, v_scales, block_tables, token_rows.contiguous(),
               kv_lens.contiguous(), scale, sliding_window, logit_softcap, "paged_attention",
               [](const auto& problem, int64_t num_tokens) { attend(problem, num_tokens); });
}

void paged_attention_heads(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const OptionalTensor& k_scales, const OptionalTensor& v_scales,
                           const at::Tensor& block_tables, const at::Tensor& token_rows, const at::Tensor& kv_lens,
                           double scale, int64_t sliding_window, double logit_softcap, int64_t kv_first,
                           int64_t kv_end) {
  TORCH_CHECK(0 <= kv_first && kv_first <= kv_end && kv_end <= k_cache.size(1),
              "paged_attention_heads: kv heads must be a range within 0..", k_cache.size(1));
  with_problem(out, q, k_cache, v_cache, k_scales, v_scales, block_tables, token_rows, kv_lens, scale,
               sliding_window, logit_softcap, "paged_attention_heads", [&](const auto& problem, int64_t num_tokens) {
    if (kv_first == kv_end) return;
    Scratch scratch;
    for (int64_t token = 0; token < num_tokens; ++token) attend_token(problem, token, kv_first, kv_end, scratch);
  });
}

void prefetch_kv_heads(const at::Tensor& k_cache, const at::Tensor& v_cache, const OptionalTensor& k_scales,
                       const OptionalTensor& v_scales, const at::Tensor& block_tables, const at::Tensor& token_rows,
                       const at::Tensor& kv_lens, int64_t sliding_window, int64_t kv_first, int64_t kv_end) {
  TORCH_CHECK(0 <= kv_first && kv_first <= kv_end && kv_end <= k_cache.size(1),
              "prefetch_kv_heads: kv heads must be a range within 0..", k_cache.size(1));
  check_caches(k_cache, v_cache, k_scales, v_scales, "prefetch_kv_heads");
  TORCH_CHECK(block_tables.is_contiguous() && token_rows.is_contiguous() && kv_lens.is_contiguous() &&
                  block_tables.scalar_type() == at::kLong && token_rows.scalar_type() == at::kLong &&
                  kv_lens.scalar_type() == at::kLong,
              "prefetch_kv_heads: index tensors must be contiguous int64");
  if (kv_first == kv_end) return;
  // The walk's extent needs no queries: a Problem with the cache and the index tensors only.
  dispatch_cache_type<float>(k_cache.scalar_type(), "prefetch_kv_heads", [&](auto element) {
    using cache_t = decltype(element);
    Problem<float, cache_t> p{paged_cache<cache_t>(k_cache, v_cache, k_scales, v_scales)};
    p.max_blocks = block_tables.size(1);
    p.window = sliding_window;
    p.tables = block_tables.data_ptr<int64_t>();
    p.rows = token_rows.data_ptr<int64_t>();
    p.lens = kv_lens.data_ptr<int64_t>();
    const int64_t heads = kv_end - kv_first, part = p.part(0, 1);   // elements of one kv head's part of a block
    for (int64_t token = 0; token < token_rows.size(0); ++token) {
      const Walk walk = walk_of(p, token);
      for (int64_t b = 0; b < walk.num_blocks; ++b) {
        prefetch(p.keys(walk.table[b], kv_first), heads * part);
        prefetch(p.values(walk.table[b], kv_first), heads * part);
        if constexpr (kScaled<cache_t>) {
          prefetch(p.key_scales(walk.table[b], kv_first), heads * p.block_size);
          prefetch(p.value_scales(walk.table[b], kv_first), heads * p.block_size);
        }
      }
    }
  });
}
