// One layer's LoRA update for a whole step in one call (Punica / S-LoRA's SGMV): for each segment of rows that
// share an adapter slot, the shrink (x . A, per part of a fused layer) and the expand (. B, into that part's
// output columns), added to out in place. Rows are reached through an index array, so rows of several adapters in
// any order, and base rows (in no segment), need no gather or scatter. As torch ops the same update was a dtype
// conversion and two or more small matmuls per segment and layer, each costing more in dispatch than in arithmetic.
// A decode step's one row is bound by reading the adapter from memory: the shrink is split by rank rows and the
// expand by column blocks, so every core reads its share of even a one-row update.
#include "lora_sgmv.h"

#include "ops.h"
#include "vectors.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <vector>

namespace {

using namespace pagedllm;

constexpr int64_t kTileRows = 4;         // rows of one slot sharing each weight vector loaded
constexpr int64_t kRankChunk = 8;        // rank rows of one part per shrink task
constexpr int64_t kColumnBlock = 128;    // output columns per expand task
constexpr int64_t kCacheLine = 64;       // bytes per prefetch hint
// A one-row update reads its adapter once, from memory, in runs of a few KB (a block of A's rank rows, B's columns
// of a rank row) too short for the hardware prefetchers: the shrink hints the CPU to fetch the block of A after
// its own, the expand each rank row's columns kExpandAhead steps on, as they read.
constexpr int64_t kExpandAhead = 2;
constexpr int64_t kExpandStep = 4 * kLanes;   // output columns per expand_block

// Hints the CPU to fetch [data, data + bytes) into L2.
inline void prefetch_bytes(const void* data, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += kCacheLine)
    __builtin_prefetch(static_cast<const char*>(data) + offset, 0, 2);
}
// Work per task that outweighs waking a thread, in multiply-adds; each weight element read counts kReadWork more,
// as a decode step's few rows are bound by reading the adapter from memory, not by arithmetic: split that way,
// one row's update of one layer runs on every core.
constexpr int64_t kTaskWork = 1 << 15;
constexpr int64_t kReadWork = 4;

using Tile = LoRAUpdate::Tile;
using ShrinkTask = LoRAUpdate::ShrinkTask;
using Step = LoRAUpdate::Step;

// h[t][j] = x_t . a_j for J rank rows a_j of one slot's A (rows `in` apart) and T rows x_t (float, zero-padded
// to whole vectors, in_padded apart): T * J independent accumulators keep the FMA units busy even for one row.
// The J rows after these are fetched as these are read.
template <int T, int J, typename lora_t>
void shrink_block(float* h, int64_t h_stride, const float* xs, const lora_t* a, const Step& s) {
  vfloat acc[T][J] = {};
  const lora_t* next = a + J * s.in;
  for (int64_t i = 0; i < s.in; i += kLanes) {
    prefetch_bytes(next + J * i, J * kLanes * static_cast<int64_t>(sizeof(lora_t)));
    const int64_t width = std::min<int64_t>(kLanes, s.in - i);
    vfloat w[J];
    for (int j = 0; j < J; ++j) w[j] = width == kLanes ? widen(a + j * s.in + i) : widen_partial(a + j * s.in + i, width);
    for (int t = 0; t < T; ++t) {
      const vfloat v = widen(xs + t * s.in_padded + i);
      for (int j = 0; j < J; ++j) acc[t][j] += v * w[j];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < J; ++j) h[t * h_stride + j] = sum_lanes(acc[t][j]);
}

// The task's rank rows of h for its tile's rows (xs: those rows in float).
template <int T, typename lora_t>
void shrink_task(float* h, const float* xs, const lora_t* a_slot, const ShrinkTask& task, const Step& s) {
  const int64_t h_stride = s.h_stride(), base = task.part * s.max_rank;
  int64_t j = task.first;
  for (; j + 4 <= task.last; j += 4) shrink_block<T, 4>(h + base + j, h_stride, xs, a_slot + (base + j) * s.in, s);
  for (; j < task.last; ++j) shrink_block<T, 1>(h + base + j, h_stride, xs, a_slot + (base + j) * s.in, s);
}

// out_t[c] += sum_k h_t[k] b[k][c] over C column vectors of one part (b's rows `out` apart), for T rows;
// kPartial: one vector of `width` < kLanes columns (a part's last columns). Whole steps fetch each rank row's
// columns kExpandAhead steps on as they read.
template <int T, int C, bool kPartial, typename scalar_t, typename lora_t>
void expand_block(scalar_t* const* out_rows, const float* h, int64_t h_stride, const lora_t* b, int64_t rank,
                  int64_t width, const Step& s) {
  vfloat acc[T][C] = {};
  for (int64_t k = 0; k < rank; ++k) {
    if constexpr (C * kLanes == kExpandStep)
      prefetch_bytes(b + k * s.out + kExpandAhead * kExpandStep, kExpandStep * static_cast<int64_t>(sizeof(lora_t)));
    vfloat w[C];
    for (int c = 0; c < C; ++c) w[c] = kPartial ? widen_partial(b + k * s.out, width) : widen(b + k * s.out + c * kLanes);
    for (int t = 0; t < T; ++t) {
      const float weight = h[t * h_stride + k];
      for (int c = 0; c < C; ++c) acc[t][c] += weight * w[c];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) {
      scalar_t* o = out_rows[t] + c * kLanes;
      if constexpr (kPartial) {
        scalar_t padded[kLanes] = {};
        narrow(widen_partial(o, width) + acc[t][c], padded);
        std::copy(padded, padded + width, o);
      } else {
        narrow(widen(o) + acc[t][c], o);
      }
    }
}

// The tile's update of columns [begin, end), part by part.
template <int T, typename scalar_t, typename lora_t>
void expand_tile(scalar_t* out, const float* h_tile, const Tile& tile, const lora_t* b_slot, int64_t begin, int64_t end,
                 const Step& s) {
  const int64_t h_stride = s.h_stride();
  for (int64_t p = 0; p < s.parts; ++p) {
    const int64_t rank = s.rank_of(tile.slot, p);
    const int64_t first = std::max(begin, s.column_starts[p]), last = std::min(end, s.column_starts[p + 1]);
    if (rank == 0 || first >= last) continue;
    const float* h = h_tile + p * s.max_rank;
    scalar_t* rows[T];
    auto at = [&](int64_t column) {
      for (int t = 0; t < T; ++t) rows[t] = out + s.rows[tile.begin + t] * s.out_stride + column;
      return rows;
    };
    int64_t c = first;
    for (; c + kExpandStep <= last; c += kExpandStep) expand_block<T, 4, false>(at(c), h, h_stride, b_slot + c, rank, 0, s);
    for (; c + kLanes <= last; c += kLanes) expand_block<T, 1, false>(at(c), h, h_stride, b_slot + c, rank, 0, s);
    if (c < last) expand_block<T, 1, true>(at(c), h, h_stride, b_slot + c, rank, last - c, s);
  }
}

// f<T>() for the tile's row count T (1..kTileRows), so the micro-kernels hold their accumulators in registers.
template <typename F>
void with_rows(int64_t count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// Grain of a parallel_for over tasks of `work` each (see kTaskWork).
int64_t grain(int64_t work) { return std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, work)); }

template <typename F>
void with_float_type(at::ScalarType type, const char* name, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "lora_sgmv: ", name, " must be float32, bfloat16 or float16, got ", type);
  }
}

// The x rows of a shrink task range's tiles widened to float (zero-padded to whole vectors), cached per tile:
// consecutive tasks mostly share one. The floats live in a buffer of the thread's kept from call to call, as a
// decode step's 120 updates each allocated and zero-filled one on every thread.
template <typename scalar_t>
class WidenedRows {
 public:
  WidenedRows(const scalar_t* x, const Step& s) : x_(x), s_(s) {
    thread_local std::vector<float> kept;
    const size_t size = kTileRows * s.in_padded;
    if (kept.size() < size) kept.resize(size);
    floats_ = kept.data();
  }
  const float* of(const Tile& tile, int64_t index) {
    if (index != widened_) {
      for (int64_t t = 0; t < tile.end - tile.begin; ++t) {
        const scalar_t* row = x_ + s_.rows[tile.begin + t] * s_.x_stride;
        float* floats = floats_ + t * s_.in_padded;
        std::transform(row, row + s_.in, floats, [](scalar_t v) { return static_cast<float>(v); });
        std::fill(floats + s_.in, floats + s_.in_padded, 0.f);
      }
      widened_ = index;
    }
    return floats_;
  }

 private:
  const scalar_t* x_;
  const Step& s_;
  float* floats_;
  int64_t widened_ = -1;
};

}  // namespace

namespace pagedllm {

template <typename F>
void LoRAUpdate::with_types(F&& f) const {
  with_float_type(x_type_, "x", [&](auto x_type) {
    with_float_type(lora_type_, "a", [&](auto lora_type) { f(x_type, lora_type); });
  });
}

LoRAWeights::LoRAWeights(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ranks,
                         const at::Tensor& column_starts) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0),
              "lora_sgmv: a [slots, parts * max_rank, in] and b [slots, max_rank, out], contiguous");
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), "lora_sgmv: b must have a's dtype");
  for (const at::Tensor* index : {&ranks, &column_starts})
    TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous(), "lora_sgmv: index tensors must be int64");
  slots = a.size(0);
  max_rank = b.size(1);
  parts = ranks.dim() == 2 ? ranks.size(1) : 0;
  in = a.size(2);
  out = b.size(2);
  type = a.scalar_type();
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(0) == slots && column_starts.numel() == parts + 1,
              "lora_sgmv: ranks [slots, parts], column_starts [parts + 1]");
  TORCH_CHECK(a.size(1) == parts * max_rank, "lora_sgmv: a's rows must be parts * b's max_rank");
  this->column_starts = column_starts.data_ptr<int64_t>();
  TORCH_CHECK(this->column_starts[0] == 0 && this->column_starts[parts] == out,
              "lora_sgmv: column_starts must span b's columns");
  this->a = a.data_ptr();
  this->b = b.data_ptr();
  this->ranks = ranks.data_ptr<int64_t>();
  with_float_type(type, "a", [](auto) {});   // refuses other dtypes here, before any thread reads them
}

LoRARowGroups::LoRARowGroups(const at::Tensor& rows, const at::Tensor& segments, int64_t step_rows) {
  for (const at::Tensor* index : {&rows, &segments})
    TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous(), "lora_sgmv: index tensors must be int64");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3, "lora_sgmv: segments [n, 3]");
  this->rows = rows.data_ptr<int64_t>();
  this->segments = segments.data_ptr<int64_t>();
  num_rows = rows.numel();
  num_segments = segments.size(0);
  for (int64_t i = 0; i < num_rows; ++i)
    TORCH_CHECK(this->rows[i] >= 0 && this->rows[i] < step_rows, "lora_sgmv: row ", this->rows[i], " out of range");
  for (int64_t i = 0; i < num_segments; ++i) {
    const int64_t* segment = this->segments + 3 * i;
    TORCH_CHECK(segment[0] >= 0 && 0 <= segment[1] && segment[1] <= segment[2] && segment[2] <= num_rows,
                "lora_sgmv: segment ", i, " (slot ", segment[0], ", ", segment[1], "-", segment[2], ") out of range");
  }
}

LoRAUpdate::LoRAUpdate(const at::Tensor& out, const at::Tensor& x, const LoRAWeights& weights,
                       const LoRARowGroups& groups)
    : out_(out.data_ptr()), x_(x.data_ptr()), a_(weights.a), b_(weights.b), x_type_(x.scalar_type()),
      lora_type_(weights.type) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "lora_sgmv: x, out must be [rows, features]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "lora_sgmv: x, out rows must be contiguous");
  TORCH_CHECK(out.scalar_type() == x_type_, "lora_sgmv: out must have x's dtype");
  TORCH_CHECK(weights.in == x.size(1) && weights.out == out.size(1), "lora_sgmv: a, b do not fit x, out");
  with_float_type(x_type_, "x", [](auto) {});   // refuses other dtypes here, before any thread runs a share

  const int64_t parts = weights.parts;
  for (int64_t i = 0; i < groups.num_segments; ++i) {
    const int64_t* segment = groups.segments + 3 * i;
    const int64_t slot = segment[0], begin = segment[1], end = segment[2];
    TORCH_CHECK(slot < weights.slots, "lora_sgmv: segment ", i, " (slot ", slot, ", ", begin, "-", end,
                ") out of range");
    const int64_t* slot_ranks = weights.ranks + slot * parts;
    for (int64_t p = 0; p < parts; ++p)
      TORCH_CHECK(slot_ranks[p] >= 0 && slot_ranks[p] <= weights.max_rank, "lora_sgmv: a rank over b's max_rank");
    if (std::all_of(slot_ranks, slot_ranks + parts, [](int64_t r) { return r == 0; }))
      continue;   // the adapter leaves this layer alone
    for (int64_t first = begin; first < end; first += kTileRows) tiles_.push_back({slot, first, std::min(end, first + kTileRows)});
  }
  if (tiles_.empty()) return;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles_.size()); ++t)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t j = 0, rank = weights.ranks[tiles_[t].slot * parts + p]; j < rank; j += kRankChunk)
        shrinks_.push_back({t, p, j, std::min(rank, j + kRankChunk)});
  h_size_ = groups.num_rows * parts * weights.max_rank;
  step_ = Step{weights.in, (weights.in + kLanes - 1) / kLanes * kLanes, weights.out, parts, weights.max_rank,
               x.stride(0), out.stride(0), weights.ranks, weights.column_starts, groups.rows};
}

void LoRAUpdate::shrink_tasks(float* h, int64_t first, int64_t last) const {
  if (first >= last) return;
  const Step& s = step_;
  with_types([&](auto x_type, auto lora_type) {
    using scalar_t = decltype(x_type);
    using lora_t = decltype(lora_type);
    const lora_t* a_data = static_cast<const lora_t*>(a_);
    const int64_t a_slot = s.h_stride() * s.in;
    WidenedRows<scalar_t> xs(static_cast<const scalar_t*>(x_), s);
    for (int64_t index = first; index < last; ++index) {
      const ShrinkTask& task = shrinks_[index];
      const Tile& tile = tiles_[task.tile];
      const float* rows = xs.of(tile, task.tile);
      with_rows(tile.end - tile.begin, [&](auto count) {
        shrink_task<decltype(count)::value>(h + tile.begin * s.h_stride(), rows, a_data + tile.slot * a_slot, task, s);
      });
    }
  });
}

void LoRAUpdate::expand_tile(const float* h, const Tile& tile, int64_t begin, int64_t end) const {
  const Step& s = step_;
  with_types([&](auto x_type, auto lora_type) {
    using scalar_t = decltype(x_type);
    using lora_t = decltype(lora_type);
    const lora_t* b_slot = static_cast<const lora_t*>(b_) + tile.slot * s.max_rank * s.out;
    with_rows(tile.end - tile.begin, [&](auto count) {
      ::expand_tile<decltype(count)::value>(static_cast<scalar_t*>(out_), h + tile.begin * s.h_stride(), tile, b_slot,
                                            begin, end, s);
    });
  });
}

void LoRAUpdate::expand_from(const float* h, int64_t begin, int64_t end) const {
  if (begin >= end) return;
  for (const Tile& tile : tiles_) expand_tile(h, tile, begin, end);
}

void LoRAUpdate::run() const {
  if (empty()) return;
  const Step& s = step_;
  std::vector<float> h(h_size_);
  const int64_t tile_rows = std::min<int64_t>(kTileRows, tiles_.front().end - tiles_.front().begin);
  at::parallel_for(0, num_shrinks(), grain(kRankChunk * s.in * (tile_rows + kReadWork)),
                   [&](int64_t first, int64_t last) { shrink_tasks(h.data(), first, last); });
  const int64_t blocks = (s.out + kColumnBlock - 1) / kColumnBlock;
  at::parallel_for(0, static_cast<int64_t>(tiles_.size()) * blocks, grain(s.max_rank * kColumnBlock * (tile_rows + kReadWork)),
                   [&](int64_t first, int64_t last) {
    for (int64_t index = first; index < last; ++index) {
      const int64_t begin = index % blocks * kColumnBlock;
      expand_tile(h.data(), tiles_[index / blocks], begin, std::min(s.out, begin + kColumnBlock));
    }
  });
}

}  // namespace pagedllm

void lora_sgmv(at::Tensor out, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks, at::Tensor column_starts,
               at::Tensor rows, at::Tensor segments) {
  RECORD_FUNCTION("pagedllm::lora_sgmv", std::vector<c10::IValue>({out}));   // torch.profiler names it
  const pagedllm::LoRAWeights weights(a, b, ranks, column_starts);
  const pagedllm::LoRARowGroups groups(rows, segments, x.size(0));
  pagedllm::LoRAUpdate(out, x, weights, groups).run();
}
