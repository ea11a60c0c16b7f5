// What every sampling step needs from the raw logits, in two passes over each row instead
// of PyTorch's logsumexp (max, subtract, exp, sum, log: five) plus a separate argmax.
#include "ops.h"
#include "vectors.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

namespace {

// The first position of the row's maximum (torch.argmax's choice) and the maximum: lane by lane, then the first
// overall. vector_at(i) gives the values at [i, i + kLanes) for whole vectors, value_at(i) one value past them.
template <typename VectorAt, typename ValueAt>
std::pair<float, int64_t> first_maximum(int64_t vocab, VectorAt vector_at, ValueAt value_at) {
  using namespace pagedllm;
  const int64_t whole = vocab / kLanes * kLanes;
  vfloat lane_max = broadcast(-std::numeric_limits<float>::infinity());
  vint lane_best{}, index{};
  for (int i = 0; i < kLanes; ++i) index[i] = i;
  for (int64_t i = 0; i < whole; i += kLanes, index += kLanes) {
    const vfloat v = vector_at(i);
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
    if (value_at(i) > peak) {
      peak = value_at(i);
      argmax = i;
    }
  return {peak, argmax};
}

// first_maximum of a plain float row.
std::pair<float, int64_t> row_maximum(const float* row, int64_t vocab) {
  return first_maximum(vocab, [&](int64_t i) { return pagedllm::widen(row + i); }, [&](int64_t i) { return row[i]; });
}

}  // namespace

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
      const auto [peak, argmax] = row_maximum(row, vocab);
      vfloat sums{};
      for (int64_t i = 0; i < whole; i += kLanes) sums += exp_nonpositive(widen(row + i) - peak);
      float total = sum_lanes(sums);
      for (int64_t i = whole; i < vocab; ++i) total += std::exp(row[i] - peak);
      normalisers[r] = peak + std::log(total);
      best_ids[r] = argmax;
    }
  });
}

// Greedy rows under logit controls, without a copy of the logits: per row the first position of the maximum of
// the logits as the controls leave them. Tokens the row's bitmask disallows read as -inf; the sparse changes
// (a bias added, -inf added for a ban) are written into the row, the argmax taken, and the raw values put back.
void controlled_argmax(at::Tensor best, at::Tensor logits, at::Tensor bitmask, at::Tensor bitmask_index,
                       at::Tensor change_starts, at::Tensor change_ids, at::Tensor change_values) {
  RECORD_FUNCTION("pagedllm::controlled_argmax", std::vector<c10::IValue>({logits}));   // torch.profiler names it
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "controlled_argmax: logits must be contiguous float32 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(best.scalar_type() == at::kLong && best.numel() == rows, "controlled_argmax: best must be int64 [rows]");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  (bitmask.size(0) == 0 || words * 32 >= vocab),
              "controlled_argmax: bitmask must be contiguous int32 [masks, ceil(vocab / 32)]");
  TORCH_CHECK(bitmask_index.scalar_type() == at::kLong && bitmask_index.numel() == rows &&
                  bitmask_index.is_contiguous(),
              "controlled_argmax: bitmask_index must be int64 [rows] (-1: no mask)");
  TORCH_CHECK(change_starts.scalar_type() == at::kLong && change_starts.numel() == rows + 1 &&
                  change_starts.is_contiguous() && change_ids.scalar_type() == at::kLong &&
                  change_ids.is_contiguous() && change_values.scalar_type() == at::kFloat &&
                  change_values.is_contiguous() && change_values.numel() == change_ids.numel(),
              "controlled_argmax: change_starts int64 [rows + 1], change_ids int64 and change_values float32 alike");
  const int64_t* masks_of = bitmask_index.data_ptr<int64_t>();
  const int64_t* starts = change_starts.data_ptr<int64_t>();
  const int64_t* ids = change_ids.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[rows] == change_ids.numel(), "controlled_argmax: change_starts must span the changes");
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(starts[r] <= starts[r + 1] && masks_of[r] >= -1 && masks_of[r] < bitmask.size(0),
                "controlled_argmax: row ", r, ": change_starts must not fall, bitmask_index must be -1 or a mask");
  for (int64_t j = 0; j < change_ids.numel(); ++j)
    TORCH_CHECK(ids[j] >= 0 && ids[j] < vocab, "controlled_argmax: token ", ids[j], " outside [0, ", vocab, ")");
  using namespace pagedllm;
  const float* additions = change_values.data_ptr<float>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* data = logits.data_ptr<float>();
  int64_t* best_ids = best.data_ptr<int64_t>();
  vuint lane_bit{};
  for (int i = 0; i < kLanes; ++i) lane_bit[i] = 1u << i;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> raw;
    for (int64_t r = begin; r < end; ++r) {
      float* row = data + r * vocab;
      raw.clear();
      for (int64_t j = starts[r]; j < starts[r + 1]; ++j) raw.push_back(row[ids[j]]);   // before any change
      for (int64_t j = starts[r]; j < starts[r + 1]; ++j) row[ids[j]] += additions[j];
      if (masks_of[r] < 0) {
        best_ids[r] = row_maximum(row, vocab).second;
      } else {
        const uint32_t* mask = masks + masks_of[r] * words;
        const vfloat minus_inf = broadcast(-std::numeric_limits<float>::infinity());
        best_ids[r] = first_maximum(
            vocab,
            [&](int64_t i) {   // i is a multiple of kLanes: kLanes bits of a word
              const auto allowed = ((vuint{} + (mask[i / 32] >> (i % 32))) & lane_bit) != 0u;
              return allowed ? widen(row + i) : minus_inf;
            },
            [&](int64_t i) {
              return (mask[i / 32] >> (i % 32)) & 1u ? row[i] : -std::numeric_limits<float>::infinity();
            }).second;
      }
      for (int64_t j = starts[r]; j < starts[r + 1]; ++j) row[ids[j]] = raw[j - starts[r]];
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
        for (int part = 0; part < 32 / kLanes; ++part, chunk += kLanes) {
          const auto allowed = ((vuint{} + (bits >> (part * kLanes))) & lane_bit) != 0u;
          const vfloat v = widen(chunk);
          narrow(allowed ? v : broadcast(kMinusInf), chunk);
        }
      }
      for (int64_t t = whole_words * 32; t < vocab; ++t)
        if (!((mask[t / 32] >> (t % 32)) & 1u)) row[t] = kMinusInf;
    }
  });
}

// Top-k and top-p without sorting the vocabulary. A row's kept tokens are a prefix of its tokens ordered by
// falling logit, the lower id first among equal logits (the stable sort of the torch formula in
// worker/sampler.py): top-k keeps the first k, top-p (on what top-k kept) each token while the probability of
// the tokens before it is below top_p, the first token always. So each is told by the prefix's last token:
// top-k's from std::nth_element, top-p's from a histogram of the probability mass by logit, of which only the
// one bucket where the mass crosses top_p is sorted.
namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

struct PrefixEnd {   // the last kept token
  float value;
  int64_t id;
};

// Every token after the prefix to -inf: a logit below the end's, or equal to it with a higher id.
void drop_after(float* row, int64_t vocab, PrefixEnd end) {
  using namespace pagedllm;
  const int64_t whole = vocab / kLanes * kLanes;
  const vfloat cut = broadcast(end.value);
  const vint last = vint{} + static_cast<int32_t>(end.id);
  vint index{};
  for (int i = 0; i < kLanes; ++i) index[i] = i;
  for (int64_t i = 0; i < whole; i += kLanes, index += kLanes) {
    const vfloat v = widen(row + i);
    const vint drop = (v < cut) | ((v == cut) & (index > last));
    narrow(drop ? broadcast(kMinusInf) : v, row + i);
  }
  for (int64_t i = whole; i < vocab; ++i)
    if (row[i] < end.value || (row[i] == end.value && i > end.id)) row[i] = kMinusInf;
}

// The k-th token (k < vocab): nth_element finds its logit, then the ids settle ties.
PrefixEnd top_k_end(const float* row, int64_t vocab, int64_t k, std::vector<float>& values) {
  values.resize(vocab);
  for (int64_t i = 0; i < vocab; ++i) values[i] = row[i] == row[i] ? row[i] : kMinusInf;   // NaN breaks the order
  std::nth_element(values.begin(), values.begin() + (k - 1), values.end(), std::greater<float>());
  const float kth = values[k - 1];
  int64_t ties = k - std::count_if(values.begin(), values.begin() + (k - 1), [&](float x) { return x > kth; });
  for (int64_t id = 0; id < vocab; ++id)
    if (row[id] == kth && --ties == 0) return {kth, id};
  return {kth, vocab - 1};   // only a NaN mapped to -inf above leaves fewer ties in the row
}

// Buckets of logits below the row's peak, kBuckets slices of 1/64 each over kSpan, then one for everything lower
// (-inf and NaN too). exp(-32) per token leaves the last bucket under 1e-9 of the mass over 49,152 tokens, so
// top-p crosses there only for top_p within float32's last steps below 1.
constexpr int kBuckets = 2048;
constexpr float kSpan = 32.f;

inline pagedllm::vint bucket_of(pagedllm::vfloat v, pagedllm::vfloat peak) {
  using namespace pagedllm;
  const vfloat slices = (peak - v) * (kBuckets / kSpan);
  return __builtin_convertvector(slices < static_cast<float>(kBuckets) ? slices : broadcast(kBuckets), vint);
}

struct Candidate {
  float value;
  int32_t id;
  float mass;   // exp(value - peak)
};

// Calls visit(v, masses, buckets, first id, lanes) for the row in vectors; the tail padded with -inf.
template <typename Visit>
void for_each_vector(const float* row, int64_t vocab, pagedllm::vfloat peak, Visit visit) {
  using namespace pagedllm;
  auto visit_vector = [&](const float* values, int64_t first, int lanes) {
    const vfloat v = widen(values);
    const vfloat mass = v > kMinusInf ? exp_nonpositive(v - peak) : vfloat{};
    visit(v, mass, bucket_of(v, peak), first, lanes);
  };
  const int64_t whole = vocab / kLanes * kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) visit_vector(row + i, i, kLanes);
  if (whole < vocab) {
    float padded[kLanes];
    std::fill(padded, padded + kLanes, kMinusInf);
    std::copy(row + whole, row + vocab, padded);
    visit_vector(padded, whole, static_cast<int>(vocab - whole));
  }
}

// The last token top-p keeps (top_p < 1), or none when it keeps the whole row.
std::optional<PrefixEnd> top_p_end(const float* row, int64_t vocab, float top_p, std::vector<double>& masses,
                                   std::vector<Candidate>& candidates) {
  using namespace pagedllm;
  const float peak_value = row_maximum(row, vocab).first;
  if (!(peak_value > kMinusInf) || std::isinf(peak_value)) return std::nullopt;   // no finite logit
  const vfloat peak = broadcast(peak_value);
  std::fill(masses.begin(), masses.end(), 0.0);
  // The last bucket's lanes are summed as a vector: one slot taking every token of a long run of them (the
  // disallowed tokens of an allowed_token_ids row, all -inf) chained each add through memory, which made such a
  // row about twice as slow as a plain one.
  vfloat far_mass{};
  for_each_vector(row, vocab, peak, [&](vfloat, vfloat mass, vint bucket, int64_t, int lanes) {
    far_mass += bucket == kBuckets ? mass : vfloat{};
    for (int j = 0; j < lanes; ++j)
      if (bucket[j] < kBuckets) masses[bucket[j]] += mass[j];
  });
  masses[kBuckets] = sum_lanes(far_mass);
  double total = 0;
  for (double mass : masses) total += mass;
  const double target = static_cast<double>(top_p) * total;
  double above = 0;   // the mass of the buckets before
  int crossing = 0;
  for (; crossing <= kBuckets && above + masses[crossing] < target; ++crossing) above += masses[crossing];
  if (crossing > kBuckets) return std::nullopt;
  candidates.clear();
  for_each_vector(row, vocab, peak, [&](vfloat v, vfloat mass, vint bucket, int64_t first, int lanes) {
    for (int j = 0; j < lanes; ++j)
      if (bucket[j] == crossing) candidates.push_back({v[j], static_cast<int32_t>(first + j), mass[j]});
  });
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return a.value > b.value || (a.value == b.value && a.id < b.id);
  });
  std::optional<PrefixEnd> end;
  for (size_t j = 0; j < candidates.size(); ++j) {
    if (above >= target && end) break;   // the row's first token (the first of bucket 0) always stays
    end = PrefixEnd{candidates[j].value, candidates[j].id};
    above += candidates[j].mass;
  }
  return end;
}

}  // namespace

void truncate_top_k_top_p(at::Tensor logits, std::optional<at::Tensor> top_k, std::optional<at::Tensor> top_p) {
  RECORD_FUNCTION("pagedllm::truncate_top_k_top_p", std::vector<c10::IValue>({logits}));   // torch.profiler names it
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "truncate_top_k_top_p: logits must be contiguous float32 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab < (int64_t{1} << 31), "truncate_top_k_top_p: vocab must fit int32, got ", vocab);
  TORCH_CHECK(!top_k || (top_k->scalar_type() == at::kLong && top_k->is_contiguous() && top_k->numel() == rows),
              "truncate_top_k_top_p: top_k must be contiguous int64 with one entry per row");
  TORCH_CHECK(!top_p || (top_p->scalar_type() == at::kFloat && top_p->is_contiguous() && top_p->numel() == rows),
              "truncate_top_k_top_p: top_p must be contiguous float32 with one entry per row");
  const int64_t* ks = top_k ? top_k->data_ptr<int64_t>() : nullptr;
  const float* ps = top_p ? top_p->data_ptr<float>() : nullptr;
  for (int64_t r = 0; ks && r < rows; ++r)
    TORCH_CHECK(ks[r] >= 1, "truncate_top_k_top_p: top_k must be at least 1 (the vocabulary size when off), got ",
                ks[r], " in row ", r);
  float* data = logits.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> values;
    std::vector<double> masses(kBuckets + 1);
    std::vector<Candidate> candidates;
    for (int64_t r = begin; r < end; ++r) {
      float* row = data + r * vocab;
      if (ks && ks[r] < vocab) drop_after(row, vocab, top_k_end(row, vocab, ks[r], values));
      if (ps && ps[r] < 1.f)
        if (const auto last = top_p_end(row, vocab, ps[r], masses, candidates)) drop_after(row, vocab, *last);
    }
  });
}
