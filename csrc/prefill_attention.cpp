// Paged attention for prefill chunks on the CPU: each query token of a chunk attends to its
// sequence's keys up to its own position, read where they lie in the KV blocks, the cached
// prefix and the chunk's own keys alike (write_kv stores those first). No gather copy.
//
// Tiled like flash attention (attention_tiles.h): a task takes a run of query positions of one
// chunk and one kv head, with all the query heads that share it (its rows: positions x group),
// walks the keys a tile of blocks at a time and keeps a running maximum and sum per row (online
// softmax), so each K/V element read serves every row of the task and scores stay in
// cache-resident scratch. What depends on the model dtype (reading queries, writing the output)
// is kept apart from the key/value walk, which is built once per cache dtype. In a sliding-window
// layer a task's walk starts at its first position's first visible key.
//
// prefill_attention_brgemm walks the same tasks with the tile products as oneDNN brgemm calls
// (BrgemmTiles: bfloat16 queries and cache only), tasks of up to kBrgemmTaskRows rows padded to
// kBrgemmRowBlock: the matrix shapes stay few, and a packed K/V tile serves that many rows.
#include "ops.h"
#include "attention_tiles.h"

#include <ATen/record_function.h>

namespace {

using namespace pagedllm;

constexpr int64_t kBrgemmTaskRows = 64;
constexpr int kBrgemmRowBlock = 16;

// The brgemm path's per-thread scratch: its end gives back the AMX tiles the thread's calls took.
struct BrgemmScratch : TileScratch<c10::BFloat16> {
  ~BrgemmScratch() { BrgemmTiles::release(); }
};

template <typename Pairs, int RowBlock, typename Scratch, typename scalar_t, typename cache_t>
void attend(const at::Tensor& out, const at::Tensor& q, const PagedCache<cache_t>& cache,
            const at::Tensor& block_tables, const at::Tensor& query_starts, const at::Tensor& context_lens,
            double scale, int64_t window, double softcap, int64_t task_rows) {
  const int64_t num_kv_heads = cache.num_kv_heads, num_heads = q.size(1), group = num_heads / num_kv_heads;
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *starts = query_starts.data_ptr<int64_t>(),
                *contexts = context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1), q_token_stride = q.stride(0);
  const scalar_t* queries = q.data_ptr<scalar_t>();
  scalar_t* output = out.data_ptr<scalar_t>();
  const std::vector<ChunkTask> tasks =
      chunk_tasks(starts, contexts, context_lens.size(0), group, num_kv_heads, task_rows);
  for_each_task<Scratch>(static_cast<int64_t>(tasks.size()), [&](int64_t t, auto& scratch) {
    const ChunkTask& task = tasks[t];
    TileAttention<cache_t, Pairs, RowBlock> tiles(cache, static_cast<float>(scale), group, num_heads, scratch,
                                                  static_cast<float>(softcap));
    const int64_t start = starts[task.chunk] + task.first, position = contexts[task.chunk] + task.first;
    tiles.load(queries, q_token_stride, task.kv_head, task.count, [&](int64_t i) {
      return QueryToken{start + i, position + i, first_visible_key(position + i, window)};
    });
    tiles.walk(tables + task.chunk * max_blocks, first_visible_key(position, window), task.keys);
    tiles.store(output);
  });
}

void check_prefill(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const OptionalTensor& k_scales, const OptionalTensor& v_scales, const at::Tensor& block_tables,
                   const at::Tensor& query_starts, const at::Tensor& context_lens, int64_t sliding_window,
                   double logit_softcap, const char* op) {
  check_caches(k_cache, v_cache, k_scales, v_scales, op);
  TORCH_CHECK(out.is_contiguous() && block_tables.is_contiguous() && query_starts.is_contiguous() &&
              context_lens.is_contiguous(), op, ": tensors must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), op, ": each token's heads must be dense");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_starts.scalar_type() == at::kLong &&
              context_lens.scalar_type() == at::kLong, op, ": index tensors must be int64");
  TORCH_CHECK(query_starts.size(0) == context_lens.size(0) + 1 && block_tables.size(0) == context_lens.size(0),
              op, ": one block-table row and context length per chunk, chunk starts plus the end");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, op, ": heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= 256, op, ": head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0, op, ": sliding_window and logit_softcap must be >= 0 (0: none)");
}

}  // namespace

void prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, OptionalTensor k_scales,
                       OptionalTensor v_scales, at::Tensor block_tables, at::Tensor query_starts,
                       at::Tensor context_lens, double scale, int64_t sliding_window, double logit_softcap) {
  RECORD_FUNCTION("pagedllm::prefill_attention", std::vector<c10::IValue>({out}));   // torch.profiler names it
  check_prefill(out, q, k_cache, v_cache, k_scales, v_scales, block_tables, query_starts, context_lens, sliding_window,
                logit_softcap, "prefill_attention");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    dispatch_cache_type<scalar_t>(k_cache.scalar_type(), "prefill_attention", [&](auto element) {
      using cache_t = decltype(element);
      using Pairs = typename PairsFor<scalar_t, cache_t>::type;
      attend<Pairs, kRowBlock, TileScratch<typename Pairs::Operand>, scalar_t>(
          out, q, paged_cache<cache_t>(k_cache, v_cache, k_scales, v_scales), block_tables, query_starts,
          context_lens, scale, sliding_window, logit_softcap, kTaskRows);
    });
  });
}

void prefill_attention_brgemm(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              OptionalTensor k_scales, OptionalTensor v_scales, at::Tensor block_tables,
                              at::Tensor query_starts, at::Tensor context_lens, double scale, int64_t sliding_window,
                              double logit_softcap) {
  RECORD_FUNCTION("pagedllm::prefill_attention_brgemm", std::vector<c10::IValue>({out}));   // torch.profiler names it
  check_prefill(out, q, k_cache, v_cache, k_scales, v_scales, block_tables, query_starts, context_lens, sliding_window,
                logit_softcap, "prefill_attention_brgemm");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "prefill_attention_brgemm: queries and caches must be bfloat16, got ", q.scalar_type(), " queries and a ",
              k_cache.scalar_type(), " cache");
  using bf16 = c10::BFloat16;
  attend<BrgemmTiles, kBrgemmRowBlock, BrgemmScratch, bf16>(
      out, q, paged_cache<bf16>(k_cache, v_cache, k_scales, v_scales), block_tables, query_starts, context_lens, scale,
      sliding_window, logit_softcap, kBrgemmTaskRows);
}
