// The KV cache layout the attention kernels read (kv_cache_shapes in pagedllm/model/attention.py):
// per layer K [blocks, kv_heads, head_dim, block_size] and V [blocks, kv_heads, block_size, head_dim],
// so each kv head's part of a block is contiguous, keys stored transposed within it.
#pragma once

#include <cstdint>

namespace pagedllm {

template <typename scalar_t>
struct PagedCache {
  int64_t head_dim, num_kv_heads, block_size;
  const scalar_t *k_cache, *v_cache;

  // One kv head's part of a block: keys as [head_dim][block_size], values as [block_size][head_dim].
  const scalar_t* keys(int64_t block, int64_t kv_head) const { return k_cache + part(block, kv_head); }
  const scalar_t* values(int64_t block, int64_t kv_head) const { return v_cache + part(block, kv_head); }

 private:
  int64_t part(int64_t block, int64_t kv_head) const {
    return (block * num_kv_heads + kv_head) * head_dim * block_size;
  }
};

}  // namespace pagedllm
