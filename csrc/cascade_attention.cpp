// Cascade (shared-prefix) attention for the CPU. Sequences whose block tables start with the same
// block ids (parallel samples, beams, requests that hit the prefix cache for one system prompt)
// hold their common prefix's K/V once, in the same physical blocks; paged attention would read
// those blocks once per sequence. Here each sequence first attends to its own keys after the prefix,
// causally, as a prefill chunk does, keeping its rows' softmax state; then each group's query rows
// (its sequences' query tokens x the query heads of a kv head) attend to the shared blocks together,
// as one prefill-shaped tile walk (attention_tiles.h) that reads each shared K/V element once per task
// of up to kSharedTaskRows rows, and the two partial softmaxes are merged through their log-sum-exps.
// With bfloat16 queries and cache on AVX512-BF16, or float queries over a float or bfloat16 cache on
// AVX-512, that shared walk's products are brgemm calls over K/V tiles packed once per call
// (brgemm_tiles.h), packed while the own keys are attended. A sequence may have several query rows
// (a prefill chunk, speculative decoding's verification rows) or one (a decode). Scores may be
// soft-capped (Gemma 2's global layers); sliding-window layers never come here.
#include "ops.h"
#include "attention_tiles.h"

#include <ATen/record_function.h>

#include <memory>
#include <optional>
#include <type_traits>

namespace {

using namespace pagedllm;

// Rows per task of the shared pass: each task reads the shared K/V of one kv head once, so more rows
// read less, up to where a task's scores ([rows][tile keys] floats) stop fitting in a core's L2 cache.
constexpr int64_t kSharedTaskRows = 96;
// The brgemm shared pass pads a task's rows to a multiple of this (few distinct matrix shapes).
constexpr int kSharedRowBlock = 16;

// Query tokens [first, first + count) of a group's token list, one kv head.
struct SharedTask {
  int64_t group, kv_head, first, count;
};

// The groups as the kernel walks them: each sequence's shared length (0 outside every group), each
// group's query tokens in order, and where each group's tokens start.
struct Groups {
  std::vector<int64_t> seq_shared, tokens, token_starts;
};

Groups read_groups(const int64_t* members, const int64_t* group_starts, const int64_t* shared_lens, int64_t num_groups,
                   const int64_t* query_starts, const int64_t* context_lens, int64_t num_seqs, const int64_t* tables,
                   int64_t max_blocks, int64_t block_size) {
  Groups groups{std::vector<int64_t>(num_seqs, 0), {}, {0}};
  std::vector<bool> grouped(num_seqs, false);
  TORCH_CHECK(group_starts[0] == 0, "cascade_attention: group_starts must start at 0");
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t shared = shared_lens[g];
    TORCH_CHECK(group_starts[g] < group_starts[g + 1], "cascade_attention: every group needs a sequence");
    TORCH_CHECK(shared >= 0 && shared <= max_blocks * block_size,
                "cascade_attention: shared_lens must be within the block tables");
    const int64_t* first_table = tables + members[group_starts[g]] * max_blocks;
    const int64_t shared_blocks = (shared + block_size - 1) / block_size;
    for (int64_t i = group_starts[g]; i < group_starts[g + 1]; ++i) {
      const int64_t seq = members[i];
      TORCH_CHECK(seq >= 0 && seq < num_seqs && !grouped[seq], "cascade_attention: group_seqs must name each "
                  "sequence at most once, got ", seq, " for ", num_seqs, " sequences");
      TORCH_CHECK(shared <= context_lens[seq], "cascade_attention: a group's shared length (", shared,
                  ") must not pass any member's cached context (", context_lens[seq], ")");
      TORCH_CHECK(std::equal(first_table, first_table + shared_blocks, tables + seq * max_blocks),
                  "cascade_attention: a group's block tables must agree on the shared blocks");
      grouped[seq] = true;
      groups.seq_shared[seq] = shared;
      for (int64_t token = query_starts[seq]; token < query_starts[seq + 1]; ++token) groups.tokens.push_back(token);
    }
    groups.token_starts.push_back(static_cast<int64_t>(groups.tokens.size()));
  }
  return groups;
}

// The shared pass's tasks: each group's tokens cut in equal pieces of up to kSharedTaskRows rows, and
// in at least enough pieces to give every thread two tasks (groups of few tokens read little anyway).
std::vector<SharedTask> shared_tasks(const Groups& groups, const int64_t* shared_lens, int64_t num_groups,
                                     int64_t group, int64_t num_kv_heads) {
  const int64_t for_threads = (2 * at::get_num_threads() + num_kv_heads - 1) / num_kv_heads;
  std::vector<SharedTask> tasks;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t count = groups.token_starts[g + 1] - groups.token_starts[g];
    if (shared_lens[g] == 0) continue;
    const int64_t by_rows = (count * group + kSharedTaskRows - 1) / kSharedTaskRows;
    const int64_t pieces = std::min(count, std::max(by_rows, for_threads));
    const int64_t per_piece = (count + pieces - 1) / pieces;
    for (int64_t first = 0; first < count; first += per_piece)
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
        tasks.push_back({g, kv_head, first, std::min(per_piece, count - first)});
  }
  return tasks;
}

// Whether the shared pass runs its tile products as brgemm calls over packed tiles (BrgemmTiles<scalar_t>):
// bfloat16 queries and cache in the variant built for AVX512-BF16, where oneDNN runs bfloat16 brgemm natively (on
// AMX tiles where the CPU has them); float queries over a float or bfloat16 cache in the AVX-512 variants, where
// oneDNN's float brgemm multiplies at about twice the register tiles' rate (docs/kv-cache.md, "Float queries on
// brgemm").
template <typename scalar_t, typename cache_t>
constexpr bool kSharedByBrgemm =
#if defined(__AVX512BF16__)
    (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) ||
#endif
#if defined(__AVX512F__)
    (std::is_same_v<scalar_t, float> && (std::is_same_v<cache_t, float> || std::is_same_v<cache_t, c10::BFloat16>)) ||
#endif
    false;

// Every group's shared keys and values, each kv head, packed tile by tile as brgemm reads them
// (BrgemmTiles::pack), once per call: the shared pass's tasks of a group and kv head all read the same tiles.
template <typename Operand, typename cache_t>
class PackedShared {
  using Tiles = BrgemmTiles<Operand>;

 public:
  PackedShared(const PagedCache<cache_t>& cache, const int64_t* tables, int64_t max_blocks,
               const int64_t* members, const int64_t* group_starts, const int64_t* shared_lens, int64_t num_groups)
      : cache_(cache), tile_keys_(tile_keys_for(cache.block_size)), ld_keys_(Tiles::aligned_keys(tile_keys_)),
        tile_elements_(ld_keys_ * cache.head_dim) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t* table = tables + members[group_starts[g]] * max_blocks;
      const int64_t tiles = (shared_lens[g] + tile_keys_ - 1) / tile_keys_;
      for (int64_t kv_head = 0; kv_head < cache.num_kv_heads; ++kv_head) {
        first_tile_.push_back(static_cast<int64_t>(items_.size()));
        for (int64_t t = 0; t < tiles; ++t)
          items_.push_back({table, kv_head, t * tile_keys_, std::min(tile_keys_, shared_lens[g] - t * tile_keys_)});
      }
    }
    keys_.reset(new Operand[items_.size() * tile_elements_]);
    values_.reset(new Operand[items_.size() * tile_elements_]);
  }

  // Tiles to pack, each a task of its own.
  int64_t num_tiles() const { return static_cast<int64_t>(items_.size()); }

  void pack(int64_t i) const {
    const Item& item = items_[i];
    Tiles::pack(cache_, item.table, item.kv_head, item.key0, item.count, ld_keys_, keys_.get() + i * tile_elements_,
                values_.get() + i * tile_elements_);
  }

  typename Tiles::Packed of(int64_t group, int64_t kv_head) const {
    const int64_t first = first_tile_[group * cache_.num_kv_heads + kv_head] * tile_elements_;
    return {keys_.get() + first, values_.get() + first, 0, tile_keys_, ld_keys_, tile_elements_};
  }

 private:
  struct Item {
    const int64_t* table;
    int64_t kv_head, key0, count;
  };
  const PagedCache<cache_t>& cache_;
  const int64_t tile_keys_, ld_keys_, tile_elements_;
  std::vector<Item> items_;
  std::vector<int64_t> first_tile_;   // per group and kv head
  std::unique_ptr<Operand[]> keys_, values_;
};

template <typename scalar_t, typename cache_t>
void attend(const at::Tensor& out, const at::Tensor& q, const PagedCache<cache_t>& cache,
            const at::Tensor& block_tables, const at::Tensor& query_starts, const at::Tensor& context_lens,
            const at::Tensor& group_seqs, const at::Tensor& group_starts, const at::Tensor& shared_lens,
            double scale, float softcap) {
  using Pairs = typename PairsFor<scalar_t, cache_t>::type;
  using Scratch = TileScratch<typename Pairs::Operand>;
  const int64_t num_kv_heads = cache.num_kv_heads, num_heads = q.size(1), group = num_heads / num_kv_heads;
  const int64_t head_dim = cache.head_dim, max_blocks = block_tables.size(1), q_token_stride = q.stride(0);
  const int64_t num_seqs = context_lens.size(0), num_groups = shared_lens.size(0);
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *starts = query_starts.data_ptr<int64_t>(),
                *contexts = context_lens.data_ptr<int64_t>(), *shared = shared_lens.data_ptr<int64_t>(),
                *members = group_seqs.data_ptr<int64_t>(), *firsts = group_starts.data_ptr<int64_t>();
  const Groups groups = read_groups(members, firsts, shared, num_groups, starts, contexts, num_seqs, tables,
                                    max_blocks, cache.block_size);
  const scalar_t* queries = q.data_ptr<scalar_t>();
  scalar_t* output = out.data_ptr<scalar_t>();
  const float softmax_scale = static_cast<float>(scale);
  std::optional<PackedShared<scalar_t, cache_t>> packed;
  if constexpr (kSharedByBrgemm<scalar_t, cache_t>)
    packed.emplace(cache, tables, max_blocks, members, firsts, shared, num_groups);
  const int64_t num_packs = packed ? packed->num_tiles() : 0;

  // Pass 1: each sequence against its own keys after the shared ones; a grouped sequence's rows keep their state
  // for pass 2, the others are done. The brgemm path packs the shared tiles in the same pass.
  const int64_t num_rows = q.size(0) * num_heads;
  std::vector<float> acc(num_rows * head_dim), peak(num_rows), total(num_rows);
  const RowStates states{acc.data(), peak.data(), total.data(), num_heads, head_dim};
  const std::vector<ChunkTask> suffix_tasks = chunk_tasks(starts, contexts, num_seqs, group, num_kv_heads);
  for_each_task<Scratch>(num_packs + static_cast<int64_t>(suffix_tasks.size()), [&](int64_t t, Scratch& scratch) {
    if (t < num_packs) {
      if constexpr (kSharedByBrgemm<scalar_t, cache_t>) packed->pack(t);
      return;
    }
    const ChunkTask& task = suffix_tasks[t - num_packs];
    const int64_t start = starts[task.chunk] + task.first, position = contexts[task.chunk] + task.first;
    const int64_t prefix = groups.seq_shared[task.chunk];
    auto attend_own_keys = [&](auto&& tiles) {
      tiles.load(queries, q_token_stride, task.kv_head, task.count,
                 [&](int64_t i) { return QueryToken{start + i, position + i}; });
      tiles.walk(tables + task.chunk * max_blocks, prefix, task.keys);
      if (prefix > 0)
        tiles.save(states);
      else
        tiles.store(output);
    };
    if (task.count * group <= kFewRowBlock)   // a decode's rows
      attend_own_keys(TileAttention<cache_t, Pairs, kFewRowBlock>(cache, softmax_scale, group, num_heads, scratch,
                                                                  softcap));
    else
      attend_own_keys(TileAttention<cache_t, Pairs>(cache, softmax_scale, group, num_heads, scratch, softcap));
  });

  // Pass 2: each group's rows against its shared keys (its first member's blocks), merged with pass 1's state.
  const std::vector<SharedTask> prefix_tasks = shared_tasks(groups, shared, num_groups, group, num_kv_heads);
  auto attend_shared = [&](const SharedTask& task, auto&& tiles, auto&& keys) {
    const int64_t* tokens = groups.tokens.data() + groups.token_starts[task.group] + task.first;
    tiles.load(queries, q_token_stride, task.kv_head, task.count,
               [&](int64_t i) { return QueryToken{tokens[i], kSeesAllKeys}; });
    tiles.walk(keys, 0, shared[task.group]);
    tiles.fold(states);
    tiles.store(output);
  };
  if constexpr (kSharedByBrgemm<scalar_t, cache_t>) {
    using Tiles = BrgemmTiles<scalar_t>;
    for_each_task<BrgemmScratch<scalar_t>>(static_cast<int64_t>(prefix_tasks.size()), [&](int64_t t, auto& scratch) {
      const SharedTask& task = prefix_tasks[t];
      attend_shared(task, TileAttention<cache_t, Tiles, kSharedRowBlock>(cache, softmax_scale, group, num_heads,
                                                                         scratch, softcap),
                    packed->of(task.group, task.kv_head));
    });
  } else {
    for_each_task<Scratch>(static_cast<int64_t>(prefix_tasks.size()), [&](int64_t t, Scratch& scratch) {
      const SharedTask& task = prefix_tasks[t];
      attend_shared(task, TileAttention<cache_t, Pairs, kManyRowBlock>(cache, softmax_scale, group, num_heads,
                                                                       scratch, softcap),
                    tables + members[firsts[task.group]] * max_blocks);
    });
  }
}

}  // namespace

void cascade_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, OptionalTensor k_scales,
                       OptionalTensor v_scales, at::Tensor block_tables, at::Tensor query_starts,
                       at::Tensor context_lens, at::Tensor group_seqs, at::Tensor group_starts,
                       at::Tensor shared_lens, double scale, double logit_softcap) {
  RECORD_FUNCTION("pagedllm::cascade_attention", std::vector<c10::IValue>({out}));   // torch.profiler names it
  check_caches(k_cache, v_cache, k_scales, v_scales, "cascade_attention");
  for (const at::Tensor& t : {block_tables, query_starts, context_lens, group_seqs, group_starts, shared_lens})
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kLong,
                "cascade_attention: index tensors must be contiguous int64");
  TORCH_CHECK(out.is_contiguous(), "cascade_attention: out must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "cascade_attention: each token's heads must be dense");
  TORCH_CHECK(query_starts.size(0) == context_lens.size(0) + 1 && block_tables.size(0) == context_lens.size(0),
              "cascade_attention: one block-table row and context length per sequence, sequence starts plus the end");
  TORCH_CHECK(group_starts.size(0) == shared_lens.size(0) + 1 &&
              group_starts[-1].item<int64_t>() == group_seqs.size(0),
              "cascade_attention: group_starts must hold each group's first index into group_seqs, plus the end");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "cascade_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= 256,
              "cascade_attention: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(logit_softcap >= 0, "cascade_attention: logit_softcap must be >= 0 (0: none)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "cascade_attention", [&] {
    dispatch_cache_type<scalar_t>(k_cache.scalar_type(), "cascade_attention", [&](auto element) {
      using cache_t = decltype(element);
      attend<scalar_t>(out, q, paged_cache<cache_t>(k_cache, v_cache, k_scales, v_scales), block_tables,
                       query_starts, context_lens, group_seqs, group_starts, shared_lens, scale,
                       static_cast<float>(logit_softcap));
    });
  });
}
