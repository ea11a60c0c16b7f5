// The KV cache layout the attention kernels read and write_kv fills (kv_cache_shapes in
// pagedllm/model/attention.py): per layer K [blocks, kv_heads, head_dim, block_size] and V
// [blocks, kv_heads, block_size, head_dim], so each kv head's part of a block is contiguous, keys
// stored transposed within it. The elements are the model dtype, bfloat16, float16, float8 e5m2
// or int8 (kv_cache_dtype). An int8 cache has float32 scales beside it, one per slot and kv head,
// K's and V's each [blocks, kv_heads, block_size]: an element's value is its int8 times its slot's scale.
#pragma once

#include <ATen/ATen.h>

#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <optional>
#include <type_traits>

namespace pagedllm {

// Whether caches of this element type carry scales.
template <typename cache_t>
constexpr bool kScaled = std::is_same_v<cache_t, int8_t>;

struct CacheLayout {
  int64_t head_dim, num_kv_heads, block_size;

  // Where one kv head's part of a block starts: in elements, and in its scales.
  int64_t part(int64_t block, int64_t kv_head) const { return scale_part(block, kv_head) * head_dim; }
  int64_t scale_part(int64_t block, int64_t kv_head) const {
    return (block * num_kv_heads + kv_head) * block_size;
  }
};

template <typename cache_t>
struct PagedCache : CacheLayout {
  const cache_t *k_cache, *v_cache;
  const float *k_scales, *v_scales;   // int8 caches only, else null

  // One kv head's part of a block: keys as [head_dim][block_size], values as [block_size][head_dim].
  const cache_t* keys(int64_t block, int64_t kv_head) const { return k_cache + part(block, kv_head); }
  const cache_t* values(int64_t block, int64_t kv_head) const { return v_cache + part(block, kv_head); }
  // Their scales, one per slot of the block.
  const float* key_scales(int64_t block, int64_t kv_head) const { return k_scales + scale_part(block, kv_head); }
  const float* value_scales(int64_t block, int64_t kv_head) const { return v_scales + scale_part(block, kv_head); }
};

using OptionalTensor = std::optional<at::Tensor>;

// The checks every kernel that takes one layer's caches makes: contiguous, K and V alike, and
// scales (float32, one per slot and kv head) exactly where the elements are int8.
inline void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const OptionalTensor& k_scales,
                         const OptionalTensor& v_scales, const char* op) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": caches must be contiguous");
  // K [blocks, kv_heads, head_dim, block_size] against V [blocks, kv_heads, block_size, head_dim], compared in place:
  // a transposed view would be a dispatched op per kernel call (two a layer, every step).
  const at::IntArrayRef k = k_cache.sizes(), v = v_cache.sizes();
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k.size() == 4 && v.size() == 4 && k[0] == v[0] &&
                  k[1] == v[1] && k[2] == v[3] && k[3] == v[2],
              op, ": K and V caches must match");
  const bool scaled = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_scales.has_value() == scaled && v_scales.has_value() == scaled, op,
              ": int8 caches take scales, the other dtypes none");
  if (!scaled) return;
  const std::vector<int64_t> shape{k_cache.size(0), k_cache.size(1), k_cache.size(3)};
  for (const at::Tensor& scales : {*k_scales, *v_scales})
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.sizes() == shape, op,
                ": scales must be contiguous float32 [blocks, kv_heads, block_size]");
}

template <typename cache_t>
PagedCache<cache_t> paged_cache(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const OptionalTensor& k_scales, const OptionalTensor& v_scales) {
  auto scales = [](const OptionalTensor& t) { return t ? t->data_ptr<float>() : nullptr; };
  return {{k_cache.size(2), k_cache.size(1), k_cache.size(3)}, static_cast<const cache_t*>(k_cache.data_ptr()),
          static_cast<const cache_t*>(v_cache.data_ptr()), scales(k_scales), scales(v_scales)};
}

// Calls f(cache_t{}) with the C++ type of a cache's elements: the model's scalar_t, or one of
// the KV cache dtypes that differ from it.
template <typename scalar_t, typename F>
void dispatch_cache_type(at::ScalarType type, const char* op, F&& f) {
  if (type == c10::CppTypeToScalarType<scalar_t>::value) return f(scalar_t{});
  switch (type) {
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    case at::kFloat8_e5m2: return f(c10::Float8_e5m2{});
    case at::kChar: return f(int8_t{});
    default:
      TORCH_CHECK(false, op, ": no kernel for a ", type, " KV cache with ",
                  c10::CppTypeToScalarType<scalar_t>::value, " queries");
  }
}

}  // namespace pagedllm
