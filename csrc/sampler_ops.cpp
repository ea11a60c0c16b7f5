// What every sampling step needs from the raw logits, in two passes over each row instead
// of PyTorch's logsumexp (max, subtract, exp, sum, log: five) plus a separate argmax.
#include "ops.h"
#include "vectors.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

void logits_summary(at::Tensor log_normaliser, at::Tensor best, at::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "logits_summary: logits must be contiguous float32 [rows, vocab]");
  TORCH_CHECK(log_normaliser.scalar_type() == at::kFloat && best.scalar_type() == at::kLong,
              "logits_summary: outputs float32 and int64");
  using namespace pagedllm;
  const int64_t rows = logits.size(0), vocab = logits.size(1), whole = vocab / kLanes * kLanes;
  const float* data = logits.data_ptr<float>();
  float* normalisers = log_normaliser.data_ptr<float>();
  int64_t* best_ids = best.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * vocab;
      // Lane by lane, the first position of each lane's maximum; then the first overall.
      vfloat lane_max = broadcast(-std::numeric_limits<float>::infinity());
      vint lane_best{}, index{};
      for (int i = 0; i < kLanes; ++i) index[i] = i;
      for (int64_t i = 0; i < whole; i += kLanes, index += kLanes) {
        const vfloat v = widen(row + i);
        const vint better = v > lane_max;
        lane_max = better ? v : lane_max;
        lane_best = better ? index : lane_best;
      }
      float peak = -std::numeric_limits<float>::infinity();
      int64_t argmax = 0;
      for (int i = 0; i < kLanes; ++i)
        if (lane_max[i] > peak || (lane_max[i] == peak && lane_best[i] < argmax)) {
          peak = lane_max[i];
          argmax = lane_best[i];
        }
      for (int64_t i = whole; i < vocab; ++i)
        if (row[i] > peak) {
          peak = row[i];
          argmax = i;
        }
      vfloat sums{};
      for (int64_t i = 0; i < whole; i += kLanes) sums += exp_nonpositive(widen(row + i) - peak);
      float total = sum_lanes(sums);
      for (int64_t i = whole; i < vocab; ++i) total += std::exp(row[i] - peak);
      normalisers[r] = peak + std::log(total);
      best_ids[r] = argmax;
    }
  });
}
