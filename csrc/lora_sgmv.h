// One layer's LoRA update for one step (lora_sgmv.cpp), checked and planned once, then run: the shrink (x . A)
// and the expand (. B, added to out). lora_sgmv runs the two over the cores itself, a parallel region each; the
// compiled decode stack runs a one-row step's update inside the step's one parallel region instead
// (decode_layers.cpp), each thread its share of the shrink and of the expand's columns, as a decode step's
// 120 updates spent more in waking, joining and waiting for threads than in reading the adapter.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <cstdint>

namespace pagedllm {

// A layer's adapter slots (lora_sgmv's a, b, ranks and column_starts) checked once, as the plans read them: raw
// pointers and sizes. A one-row decode step makes 120 plans serially before its region; reaching each slot
// tensor's metadata (cold after the step's weights streamed through the caches) cost them ~1.2 us each. The
// tensors must outlive the view; their contents (an adapter loaded into a slot) may change, not their storage.
struct LoRAWeights {
  LoRAWeights(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ranks, const at::Tensor& column_starts);

  const void* a;                  // [slots, parts * max_rank, in]
  const void* b;                  // [slots, max_rank, out]
  const int64_t* ranks;           // [slots, parts]
  const int64_t* column_starts;   // [parts + 1]
  int64_t slots, parts, max_rank, in, out;
  at::ScalarType type;            // a's and b's
};

// A step's rows grouped by adapter slot (lora_sgmv's rows and segments), checked once a step against its rows.
struct LoRARowGroups {
  LoRARowGroups(const at::Tensor& rows, const at::Tensor& segments, int64_t step_rows);

  const int64_t* rows;       // the step row at each position
  const int64_t* segments;   // [num_segments, 3]: slot, first position, end position
  int64_t num_rows, num_segments;
};

class LoRAUpdate {
 public:
  // out (x's rows) += the update of the rows in `groups`, checked (errors name the argument); rows cut into tiles
  // of one slot. out, x and what weights and groups view must outlive the update. A one-row plan (one tile, a few
  // shrink tasks) allocates nothing.
  LoRAUpdate(const at::Tensor& out, const at::Tensor& x, const LoRAWeights& weights, const LoRARowGroups& groups);
  LoRAUpdate(const LoRAUpdate&) = delete;   // a plan for one step's tensors, made in place
  LoRAUpdate& operator=(const LoRAUpdate&) = delete;

  bool empty() const { return tiles_.empty(); }   // no row's adapter changes this layer
  int64_t num_shrinks() const { return static_cast<int64_t>(shrinks_.size()); }

  // A one-row decode step's threads each run a share of the shrink's tasks (x . A, a chunk of rank rows each)
  // into one shared h (h_size() floats), then, once every share is in h, the expand of their own columns (out's
  // columns [begin, end) of every adapter row += h . B) (decode_layers.cpp). Each thread running the whole shrink
  // read all of A (half the adapter's bytes) twice over a step; split, the adapter step costs ~2 points less.
  int64_t h_size() const { return h_size_; }
  void shrink_tasks(float* h, int64_t first, int64_t last) const;
  void expand_from(const float* h, int64_t begin, int64_t end) const;
  // All of it, the shrink and then the expand each split over the cores (what lora_sgmv runs).
  void run() const;

  // The plan's parts, as the kernels in lora_sgmv.cpp read them.
  struct Tile {
    int64_t slot, begin, end;   // positions in `rows`, at most kTileRows, all of one slot
  };
  struct ShrinkTask {
    int64_t tile, part, first, last;   // rank rows [first, last) of the part, for the tile's rows
  };
  struct Step {
    int64_t in, in_padded, out, parts, max_rank, x_stride, out_stride;
    const int64_t* ranks;           // [slots, parts]
    const int64_t* column_starts;   // [parts + 1]
    const int64_t* rows;            // the step row at each position
    int64_t h_stride() const { return parts * max_rank; }   // h: [positions, parts * max_rank], the shrink's results
    int64_t rank_of(int64_t slot, int64_t part) const { return ranks[slot * parts + part]; }
  };

 private:
  // The tile's rows' columns [begin, end) += h . B.
  void expand_tile(const float* h, const Tile& tile, int64_t begin, int64_t end) const;
  template <typename F>
  void with_types(F&& f) const;   // f(x's element, the adapter's element)

  void* out_;
  const void* x_;
  const void* a_;
  const void* b_;
  at::ScalarType x_type_, lora_type_;
  // Inline room for one row of rank up to 16 over three parts (2 rank chunks each); more spills to the heap.
  c10::SmallVector<Tile, 1> tiles_;
  c10::SmallVector<ShrinkTask, 6> shrinks_;
  int64_t h_size_ = 0;
  Step step_{};
};

}  // namespace pagedllm
