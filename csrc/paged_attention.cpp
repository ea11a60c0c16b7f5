// Paged attention for the CPU: each query token attends to its sequence's keys and
// values where they lie, in KV blocks reached through the block table. No gather copy,
// no padding to the longest sequence. Used for decode tokens; prefills go through
// PyTorch's flash-attention kernel. A decode step reads every cached K/V row once, so the
// kernel should run at memory speed: rows are widened to floats 16 lanes at a time and
// the softmax's exp is a vector polynomial, not a libm call per score.
#include "ops.h"
#include "vectors.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace {

using namespace pagedllm;

// The shapes of one call, and the raw pointers the tasks read.
template <typename scalar_t>
struct Problem {
  int64_t head_dim, group, num_kv_heads, block_size, max_blocks, q_token_stride;
  float scale;
  const scalar_t *q, *k_cache, *v_cache;
  scalar_t* out;
  const int64_t *tables, *rows, *lens;

  // One kv head's part of a block: keys as [head_dim][block_size], values as [block_size][head_dim].
  const scalar_t* head_block(const scalar_t* cache, int64_t block, int64_t kv_head) const {
    return cache + (block * num_kv_heads + kv_head) * head_dim * block_size;
  }
};

// Asks for a kv head's part of the next block while this one is computed: blocks lie
// anywhere in the cache, so the hardware prefetcher cannot guess where the next one is.
template <typename scalar_t>
inline void prefetch(const scalar_t* part, int64_t elements) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t i = 0; i < elements; i += kLine) __builtin_prefetch(part + i);
}

// How many parts ahead to ask for: 4 reads ~25% faster than 1 in a decode step of 64
// sequences x 400 tokens (measured; more was not better).
constexpr int64_t kPrefetchAhead = 4;

// Scratch space one thread reuses from task to task.
struct Scratch {
  std::vector<float> scores;
};

// One query token against one kv head, for `Heads` of the query heads that share it. Keys
// are stored transposed within a block, so the scores of 16 slots come out of plain vector
// FMAs (one query element times 16 keys), with no horizontal sums; the values are rows, so
// the output accumulates 16 dimensions at a time. Accumulators stay in registers.
template <typename scalar_t, int Heads>
void attend_heads(const Problem<scalar_t>& p, int64_t token, int64_t kv_head, int64_t first_head,
                  Scratch& scratch) {
  const int64_t head_dim = p.head_dim, block_size = p.block_size, part = head_dim * block_size;
  const int64_t kv_len = p.lens[token];
  const int64_t num_blocks = (kv_len + block_size - 1) / block_size;
  const int64_t* table = p.tables + p.rows[token] * p.max_blocks;
  const int64_t padded_len = num_blocks * block_size;   // scores of slots past kv_len are dropped
  const int64_t heads_per_token = p.num_kv_heads * p.group;
  const scalar_t* q = p.q + token * p.q_token_stride + first_head * head_dim;

  float query[Heads][256];   // head_dim <= 256, checked at the entry point
  for (int h = 0; h < Heads; ++h)
    for (int64_t d = 0; d < head_dim; ++d) query[h][d] = static_cast<float>(q[h * head_dim + d]) * p.scale;
  scratch.scores.resize(Heads * padded_len);
  float* scores = scratch.scores.data();

  // The task reads its K parts, then its V parts: part i of that sequence is asked for
  // kPrefetchAhead parts before it is needed.
  auto prefetch_part = [&](int64_t i) {
    if (i < num_blocks) prefetch(p.head_block(p.k_cache, table[i], kv_head), part);
    else if (i < 2 * num_blocks) prefetch(p.head_block(p.v_cache, table[i - num_blocks], kv_head), part);
  };
  for (int64_t i = 0; i < kPrefetchAhead; ++i) prefetch_part(i);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const scalar_t* keys = p.head_block(p.k_cache, table[b], kv_head);
    prefetch_part(b + kPrefetchAhead);
    for (int64_t slot = 0; slot < block_size; slot += kLanes) {
      const int64_t width = std::min<int64_t>(kLanes, block_size - slot);   // < 16 in small blocks only
      vfloat acc[Heads] = {};
      for (int64_t d = 0; d < head_dim; ++d) {
        const scalar_t* row = keys + d * block_size + slot;
        const vfloat k = width == kLanes ? widen(row) : widen_partial(row, width);
        for (int h = 0; h < Heads; ++h) acc[h] += query[h][d] * k;
      }
      for (int h = 0; h < Heads; ++h)
        std::memcpy(scores + h * padded_len + b * block_size + slot, &acc[h], width * sizeof(float));
    }
  }

  for (int h = 0; h < Heads; ++h) {
    float* s = scores + h * padded_len;
    const float peak = *std::max_element(s, s + kv_len);
    exp_in_place(s, kv_len, peak);
    float total = 0;
    for (int64_t t = 0; t < kv_len; ++t) total += s[t];
    const float inv = 1.f / total;
    for (int64_t t = 0; t < kv_len; ++t) s[t] *= inv;
  }

  scalar_t* o = p.out + (token * heads_per_token + first_head) * head_dim;
  for (int64_t c = 0; c < head_dim; c += kLanes) {
    vfloat acc[Heads] = {};
    for (int64_t b = 0, t = 0; b < num_blocks; ++b) {
      const scalar_t* values = p.head_block(p.v_cache, table[b], kv_head) + c;
      if (c == 0) prefetch_part(num_blocks + b + kPrefetchAhead);
      const int64_t n = std::min(block_size, kv_len - t);
      for (int64_t j = 0; j < n; ++j, ++t) {
        const vfloat v = widen(values + j * head_dim);
        for (int h = 0; h < Heads; ++h) acc[h] += scores[h * padded_len + t] * v;
      }
    }
    for (int h = 0; h < Heads; ++h)
      for (int i = 0; i < kLanes; ++i) o[h * head_dim + c + i] = static_cast<scalar_t>(acc[h][i]);
  }
}

// The query heads of one kv head, in tiles of up to 8 (register-resident accumulators).
template <typename scalar_t>
void attend_group(const Problem<scalar_t>& p, int64_t token, int64_t kv_head, Scratch& scratch) {
  for (int64_t done = 0; done < p.group;) {
    const int64_t first = kv_head * p.group + done;
    const int64_t tile = std::min<int64_t>(8, p.group - done);
    switch (tile) {
      case 1: attend_heads<scalar_t, 1>(p, token, kv_head, first, scratch); break;
      case 2: attend_heads<scalar_t, 2>(p, token, kv_head, first, scratch); break;
      case 3: attend_heads<scalar_t, 3>(p, token, kv_head, first, scratch); break;
      case 4: attend_heads<scalar_t, 4>(p, token, kv_head, first, scratch); break;
      case 5: attend_heads<scalar_t, 5>(p, token, kv_head, first, scratch); break;
      case 6: attend_heads<scalar_t, 6>(p, token, kv_head, first, scratch); break;
      case 7: attend_heads<scalar_t, 7>(p, token, kv_head, first, scratch); break;
      default: attend_heads<scalar_t, 8>(p, token, kv_head, first, scratch); break;
    }
    done += tile;
  }
}

template <typename scalar_t>
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& token_rows,
            const at::Tensor& kv_lens, double scale) {
  const int64_t num_tokens = q.size(0), num_kv_heads = k_cache.size(1);
  const Problem<scalar_t> p{q.size(2), q.size(1) / num_kv_heads, num_kv_heads, k_cache.size(3),
                            block_tables.size(1), q.stride(0), static_cast<float>(scale),
                            q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
                            token_rows.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>()};
  // Tokens are handed out one at a time (all kv heads of one token on one thread, whose
  // parts of each block lie side by side): sequences differ in length, so equal shares of
  // tokens would leave one thread idle while another finishes long ones.
  std::atomic<int64_t> next_token{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tokens), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t token; (token = next_token.fetch_add(1, std::memory_order_relaxed)) < num_tokens;)
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) attend_group(p, token, kv_head, scratch);
  });
}

}  // namespace

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor token_rows, at::Tensor kv_lens, double scale) {
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous(), "paged_attention: tensors must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: each token's heads must be dense");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && token_rows.scalar_type() == at::kLong &&
              kv_lens.scalar_type() == at::kLong, "paged_attention: index tensors must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= 256, "paged_attention: head_dim must be a multiple of 16, at most 256");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(out, q, k_cache, v_cache, block_tables, token_rows.contiguous(), kv_lens.contiguous(), scale);
  });
}
