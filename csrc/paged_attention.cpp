// Paged attention for the CPU: each query token attends to its sequence's keys and
// values where they lie, in KV blocks reached through the block table. No gather copy,
// no padding to the longest sequence. Used for decode tokens and for short prefill
// chunks that follow a cached prefix; long prefills go through PyTorch's SDPA.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;  // one AVX-512 register of floats; the loops below vectorise to it

// One row of head_dim values as floats: float rows are read in place, others are widened
// into `buffer`, so the hot loops run on floats only.
template <typename scalar_t>
inline const float* as_float(const scalar_t* src, float* buffer, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(src[i]);
  return buffer;
}

template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

// bfloat16 is the top half of a float: a shift the compiler turns into vector code
// (the generic cast goes through a call per element).
template <>
inline const float* as_float<c10::BFloat16>(const c10::BFloat16* src, float* buffer, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(buffer);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
  return buffer;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  float sum = 0;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

template <typename scalar_t>
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& token_rows,
            const at::Tensor& kv_lens, double scale) {
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row_size = num_kv_heads * head_dim;     // one slot: every kv head, contiguous
  const int64_t block_stride = block_size * row_size;
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* rows = token_rows.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();

  // One task per query token, all its heads at once: each cached slot is read as one
  // contiguous row of every kv head, once for K and once for V.
  at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query_buffer(num_heads * head_dim), row_buffer(row_size);
    std::vector<float> acc(num_heads * head_dim), scores;
    for (int64_t token = begin; token < end; ++token) {
      const int64_t kv_len = lens[token];
      const int64_t* table = tables + rows[token] * max_blocks;
      const float* query = as_float(q_ptr + token * num_heads * head_dim, query_buffer.data(),
                                    num_heads * head_dim);
      scores.resize(num_heads * kv_len);
      // Walk the table block by block: no division per slot.
      for (int64_t t = 0, b = 0; t < kv_len; ++b) {
        const scalar_t* block = k_ptr + table[b] * block_stride;
        const int64_t n = std::min(block_size, kv_len - t);
        for (int64_t j = 0; j < n; ++j, ++t) {
          const float* key = as_float(block + j * row_size, row_buffer.data(), row_size);
          for (int64_t h = 0; h < num_heads; ++h)
            scores[h * kv_len + t] = dot(query + h * head_dim, key + (h / group) * head_dim, head_dim) * scale;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * kv_len;
        const float peak = *std::max_element(s, s + kv_len);
        float total = 0;
        for (int64_t t = 0; t < kv_len; ++t) {
          s[t] = std::exp(s[t] - peak);
          total += s[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < kv_len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0, b = 0; t < kv_len; ++b) {
        const scalar_t* block = v_ptr + table[b] * block_stride;
        const int64_t n = std::min(block_size, kv_len - t);
        for (int64_t j = 0; j < n; ++j, ++t) {
          const float* value = as_float(block + j * row_size, row_buffer.data(), row_size);
          for (int64_t h = 0; h < num_heads; ++h) {
            const float p = scores[h * kv_len + t];
            const float* v = value + (h / group) * head_dim;
            float* a = acc.data() + h * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
          }
        }
      }
      scalar_t* o = out_ptr + token * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) o[i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

}  // namespace

// out, q: [tokens, heads, head_dim]; k_cache, v_cache: [blocks, block_size, kv_heads, head_dim];
// block_tables: [rows, max_blocks] int64; token_rows[i]: the block-table row of token i;
// kv_lens[i]: how many keys token i attends to (its position + 1).
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor token_rows, at::Tensor kv_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && block_tables.is_contiguous(), "paged_attention: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && token_rows.scalar_type() == at::kLong &&
              kv_lens.scalar_type() == at::kLong, "paged_attention: index tensors must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_attention: heads must be a multiple of kv heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(out, q, k_cache, v_cache, block_tables, token_rows.contiguous(), kv_lens.contiguous(), scale);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over KV blocks (CPU)");
}
