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
// (BrgemmTiles: bfloat16 queries and cache, or float queries over a float or bfloat16 cache) over K/V
// tiles packed once per call, tasks of up to kBrgemmTaskRows rows padded to kBrgemmRowBlock, so the
// matrix shapes stay few.
#include "ops.h"
#include "attention_tiles.h"

#include <ATen/record_function.h>

#include <memory>

namespace {

using namespace pagedllm;

constexpr int64_t kBrgemmTaskRows = 64;
constexpr int kBrgemmRowBlock = 16;
// Packed K/V a brgemm call holds at a time: past it, the chunks are packed and attended a batch at a time.
constexpr int64_t kBrgemmPackBytes = 32 << 20;

// One call's chunks and the settings every task shares.
template <typename scalar_t, typename cache_t>
struct Prefill {
  const PagedCache<cache_t>& cache;
  const scalar_t* queries;
  scalar_t* output;
  const int64_t *tables, *starts, *contexts;
  int64_t num_chunks, max_blocks, q_token_stride, num_heads, group, window;
  float scale, softcap;
};

template <typename scalar_t, typename cache_t>
Prefill<scalar_t, cache_t> prefill_of(const at::Tensor& out, const at::Tensor& q, const PagedCache<cache_t>& cache,
                                      const at::Tensor& block_tables, const at::Tensor& query_starts,
                                      const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  return {cache, q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
          query_starts.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), context_lens.size(0),
          block_tables.size(1), q.stride(0), q.size(1), q.size(1) / cache.num_kv_heads, window,
          static_cast<float>(scale), static_cast<float>(softcap)};
}

// Runs the tasks on torch's threads: each loads its rows, walks its keys (keys_of(task): its chunk's
// block-table row, or the packed tiles of its chunk and kv head) and stores its rows' outputs.
template <typename Pairs, int RowBlock, typename Scratch, typename scalar_t, typename cache_t, typename KeysOf>
void run_tasks(const std::vector<ChunkTask>& tasks, const Prefill<scalar_t, cache_t>& p, KeysOf&& keys_of) {
  for_each_task<Scratch>(static_cast<int64_t>(tasks.size()), [&](int64_t t, auto& scratch) {
    const ChunkTask& task = tasks[t];
    TileAttention<cache_t, Pairs, RowBlock> tiles(p.cache, p.scale, p.group, p.num_heads, scratch, p.softcap);
    const int64_t start = p.starts[task.chunk] + task.first, position = p.contexts[task.chunk] + task.first;
    tiles.load(p.queries, p.q_token_stride, task.kv_head, task.count, [&](int64_t i) {
      return QueryToken{start + i, position + i, first_visible_key(position + i, p.window)};
    });
    tiles.walk(keys_of(task), first_visible_key(position, p.window), task.keys);
    tiles.store(p.output);
  });
}

// The register products: K/V read in place through the block tables.
template <typename scalar_t, typename cache_t>
void attend(const Prefill<scalar_t, cache_t>& p) {
  using Pairs = typename PairsFor<scalar_t, cache_t>::type;
  const std::vector<ChunkTask> tasks =
      chunk_tasks(p.starts, p.contexts, p.num_chunks, p.group, p.cache.num_kv_heads, kTaskRows);
  run_tasks<Pairs, kRowBlock, TileScratch<typename Pairs::Operand>>(
      tasks, p, [&](const ChunkTask& task) { return p.tables + task.chunk * p.max_blocks; });
}

// The brgemm products: each batch of chunks' K/V tiles packed first (every kv head, from the tile of the
// first key a chunk's first position sees), then the batch's tasks walk the packed tiles.
template <typename scalar_t, typename cache_t>
void attend_brgemm(const Prefill<scalar_t, cache_t>& p) {
  using Tiles = BrgemmTiles<scalar_t>;
  using Packed = typename Tiles::Packed;
  const int64_t num_kv_heads = p.cache.num_kv_heads, tile_keys = tile_keys_for(p.cache.block_size);
  const int64_t ld_keys = Tiles::aligned_keys(tile_keys), tile_elements = ld_keys * p.cache.head_dim;
  auto origin = [&](int64_t chunk) {   // the packed grid's first key: a multiple of tile_keys
    const int64_t first = first_visible_key(p.contexts[chunk], p.window);
    return first - first % tile_keys;
  };
  auto end = [&](int64_t chunk) { return p.contexts[chunk] + p.starts[chunk + 1] - p.starts[chunk]; };
  auto num_tiles = [&](int64_t chunk) { return (end(chunk) - origin(chunk) + tile_keys - 1) / tile_keys; };
  for (int64_t first = 0, last; first < p.num_chunks; first = last) {
    // Chunks [first, last): their tiles (every kv head) fit kBrgemmPackBytes, or the one chunk alone.
    struct Item { int64_t chunk, kv_head, tile, at; };   // a tile to pack and its place in the buffer
    std::vector<Item> items;
    int64_t tiles = 0;
    for (last = first; last < p.num_chunks; ++last) {
      const int64_t more = num_tiles(last) * num_kv_heads;
      if (last > first && (tiles + more) * tile_elements * 2 * int64_t{sizeof(scalar_t)} > kBrgemmPackBytes)
        break;
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
        for (int64_t t = 0; t < num_tiles(last); ++t) items.push_back({last, kv_head, t, tiles++});
    }
    std::unique_ptr<scalar_t[]> keys(new scalar_t[tiles * tile_elements]), values(new scalar_t[tiles * tile_elements]);
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t stop) {
      for (int64_t i = begin; i < stop; ++i) {
        const Item& item = items[i];
        const int64_t key0 = origin(item.chunk) + item.tile * tile_keys;
        Tiles::pack(p.cache, p.tables + item.chunk * p.max_blocks, item.kv_head, key0,
                    std::min(tile_keys, end(item.chunk) - key0), ld_keys, keys.get() + item.at * tile_elements,
                    values.get() + item.at * tile_elements);
      }
    });
    std::vector<Packed> packed;   // per chunk and kv head of the batch
    for (const Item& item : items)
      if (item.tile == 0)
        packed.push_back({keys.get() + item.at * tile_elements, values.get() + item.at * tile_elements,
                          origin(item.chunk), tile_keys, ld_keys, tile_elements});
    std::vector<ChunkTask> tasks = chunk_tasks(p.starts + first, p.contexts + first, last - first, p.group,
                                               num_kv_heads, kBrgemmTaskRows);
    for (ChunkTask& task : tasks) task.chunk += first;
    run_tasks<Tiles, kBrgemmRowBlock, BrgemmScratch<scalar_t>>(tasks, p, [&](const ChunkTask& task) -> const Packed& {
      return packed[(task.chunk - first) * num_kv_heads + task.kv_head];
    });
  }
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
      const PagedCache<cache_t> cache = paged_cache<cache_t>(k_cache, v_cache, k_scales, v_scales);
      attend(prefill_of<scalar_t>(out, q, cache, block_tables, query_starts, context_lens, scale, sliding_window,
                                  logit_softcap));
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
  const at::ScalarType queries = q.scalar_type(), held = k_cache.scalar_type();
  TORCH_CHECK((queries == at::kBFloat16 && held == at::kBFloat16) ||
              (queries == at::kFloat && (held == at::kFloat || held == at::kBFloat16)),
              "prefill_attention_brgemm: needs bfloat16 queries and caches, or float queries and float or bfloat16 "
              "caches, got ", queries, " queries and a ", held, " cache");
  auto attend_over = [&](auto query_element, auto cache_element) {
    using scalar_t = decltype(query_element);
    using cache_t = decltype(cache_element);
    const PagedCache<cache_t> cache = paged_cache<cache_t>(k_cache, v_cache, k_scales, v_scales);
    attend_brgemm(prefill_of<scalar_t>(out, q, cache, block_tables, query_starts, context_lens, scale, sliding_window,
                                       logit_softcap));
  };
  if (queries == at::kBFloat16) attend_over(c10::BFloat16(), c10::BFloat16());
  else if (held == at::kFloat) attend_over(float(), float());
  else attend_over(float(), c10::BFloat16());
}
