// What every sampling step needs from the raw logits, in two passes over each row instead
// of PyTorch's logsumexp (max, subtract, exp, sum, log: five) plus a separate argmax.
#include "ops.h"
#include "vectors.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <limits>

void logits_summary(at::Tensor log_normaliser, at::Tensor best, at::Tensor logits) {
  RECORD_FUNCTION("pagedllm::logits_summary", std::vector<c10::IValue>({log_normaliser}));   // torch.profiler names it
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

// Structured outputs and allowed_token_ids: the tokens a packed bitmask row disallows set to -inf, in
// place, in the logits rows it names; other rows are not touched. One pass over a masked row; words
// that allow everything are skipped and words that allow nothing are filled (a grammar usually allows
// few tokens, so most words are zero).
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor logits_rows) {
  RECORD_FUNCTION("pagedllm::apply_token_bitmask", std::vector<c10::IValue>({logits}));   // torch.profiler names it
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "apply_token_bitmask: logits must be contiguous float32 [rows, vocab]");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be contiguous int32 [masked rows, words]");
  TORCH_CHECK(logits_rows.scalar_type() == at::kLong && logits_rows.dim() == 1 &&
                  logits_rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: logits_rows must be int64 with one entry per bitmask row");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask: bitmask has ", words, " words, the vocabulary needs ",
              (vocab + 31) / 32);
  const int64_t* targets = logits_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < logits_rows.size(0); ++i)
    TORCH_CHECK(targets[i] >= 0 && targets[i] < rows, "apply_token_bitmask: logits row ", targets[i],
                " outside [0, ", rows, ")");
  using namespace pagedllm;
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* data = logits.data_ptr<float>();
  vuint lane_bit{};
  for (int i = 0; i < kLanes; ++i) lane_bit[i] = 1u << i;
  at::parallel_for(0, logits_rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = data + targets[m] * vocab;
      const uint32_t* mask = masks + m * words;
      const int64_t whole_words = vocab / 32;
      for (int64_t w = 0; w < whole_words; ++w) {
        const uint32_t bits = mask[w];
        if (bits == ~0u) continue;
        float* chunk = row + w * 32;
        for (int half = 0; half < 2; ++half, chunk += kLanes) {
          const auto allowed = ((vuint{} + ((bits >> (half * kLanes)) & 0xffffu)) & lane_bit) != 0u;
          const vfloat v = widen(chunk);
          narrow(allowed ? v : broadcast(kMinusInf), chunk);
        }
      }
      for (int64_t t = whole_words * 32; t < vocab; ++t)
        if (!((mask[t / 32] >> (t % 32)) & 1u)) row[t] = kMinusInf;
    }
  });
}
