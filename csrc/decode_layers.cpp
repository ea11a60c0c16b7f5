// A decode step's decoder layers in one call. Batch-1 decode of a 30-layer model spent ~3.4 ms a step in
// Python between its ~11 kernels per layer (module calls, pybind conversions, an output tensor per op, views
// and splits of qkv): here the kernels run back to back on buffers made once per step and views made once.
// A one-row step (batch-1 decode) goes further: its layers run in ONE OpenMP parallel region, the threads
// meeting at barriers between the phases that need each other's results, where each kernel's own region (a
// fork, a join and a wake-up of the threads, ~3 us each on a 2-core VM) cost ~150 regions a step, and with an
// adapter on every projection the adapter's one-row update was smaller than the regions around it.
#include "decode_layers.h"

#include "ops.h"
#include "quant_format.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <optional>
#include <thread>
#include <utility>
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace pagedllm {

namespace {

using Matmul = void (*)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                        c10::optional<at::Tensor>, int64_t, int64_t);

Matmul matmul_for(const std::string& path) {
  if (path == "rows") return &quantized_linear_rows;
  if (path == "brgemm") return &quantized_linear_brgemm;
  if (path == "int8") return &quantized_linear_int8;
  if (path == "int8_tiles") return &quantized_linear_int8_tiles;
  if (path == "int16") return &quantized_linear_int16;
  TORCH_CHECK(false, "decode_layers: path must be rows, brgemm, int8, int8_tiles or int16, got ", path);
}

using MatmulShare = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, int64_t, int64_t,
                             int64_t, int64_t);

// The path's one-thread share (the one-row region's), or nullptr where it has none.
MatmulShare share_for(const std::string& path) {
  if (path == "rows") return &quantized_linear_rows_share;
  if (path == "int16") return &quantized_linear_int16_share;
  return nullptr;
}

Projection projection(const ProjectionArgs& args, int64_t out_features) {
  const auto& [qweight, scales, mins, bias, bits, group] = args;
  return {qweight, scales, mins, bias, bits, group, out_features, std::nullopt};
}

// out = x . projection, plus each adapter row's update where the projection has adapter slots: the Python
// LoRALinear's two kernels, in its order.
void run(Matmul matmul, const at::Tensor& out, const at::Tensor& x, const Projection& p, const LoRARowGroups* lora) {
  matmul(out, x, p.qweight, p.scales, p.mins, p.bias, p.bits, p.group);
  if (lora == nullptr || !p.lora) return;
  const LoRAUpdate update(out, x, p.lora->weights, *lora);
  if (update.empty()) return;
  RECORD_FUNCTION("pagedllm::lora_sgmv", std::vector<c10::IValue>({out}));   // as lora_sgmv labels it
  update.run();
}

}  // namespace

// The step's buffers, reused by every layer, and their views.
struct StepBuffers {
  at::Tensor residual, normed, qkv, attention, projected, gate_up, activated, out;
  at::Tensor q, k, v, q_rotated, k_rotated, attention_heads;
};

// The step's inputs besides its hidden states (DecodeStack::forward's arguments).
struct StepInputs {
  const at::Tensor &rope_rows, &cos_sin, &slot_mapping, &block_tables, &token_rows, &seq_lens;
  const std::vector<at::Tensor>&k_caches, &v_caches;
  const std::vector<std::optional<at::Tensor>>&k_scales, &v_scales;
  Matmul matmul;
  MatmulShare share;           // matmul's one-thread share, or nullptr: no one-row region
  const LoRARowGroups* lora;   // nullptr: no adapter rows this step
};

void DecodeStack::layers_in_turn(const StepBuffers& b, const StepInputs& in) const {
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecodeLayer& layer = layers_[i];
    if (i == 0) {
      rms_norm(b.normed, b.residual, layer.input_norm, eps_);
    } else {   // the residual stream takes the previous layer's output, and is normalised
      add_rms_norm(b.normed, b.residual, b.out, layer.input_norm, eps_);
    }
    run(in.matmul, b.qkv, b.normed, layer.qkv, in.lora);
    rotary_embedding(b.q_rotated, in.rope_rows, in.cos_sin);
    rotary_embedding(b.k_rotated, in.rope_rows, in.cos_sin);
    write_kv(in.k_caches[i], in.v_caches[i], in.k_scales[i], in.v_scales[i], b.k, b.v, in.slot_mapping);
    {
      RECORD_FUNCTION("pagedllm::decode_attention", std::vector<c10::IValue>());   // as the Python layers label it
      paged_attention(b.attention_heads, b.q, in.k_caches[i], in.v_caches[i], in.k_scales[i], in.v_scales[i],
                      in.block_tables, in.token_rows, in.seq_lens, layer.scale, layer.sliding_window,
                      layer.logit_softcap);
    }
    run(in.matmul, b.projected, b.attention, layer.o, in.lora);
    add_rms_norm(b.normed, b.residual, b.projected, layer.post_attention_norm, eps_);
    run(in.matmul, b.gate_up, b.normed, layer.gate_up, in.lora);
    silu_and_mul(b.activated, b.gate_up);
    run(in.matmul, b.out, b.activated, layer.down, in.lora);
  }
}

// Every thread runs the same sequence of phases and barriers over all layers:
//   norm (thread 0) | qkv: its share of the weight's tiles | rope, K/V write and attention of its kv heads (then
//   the next layer's K/V of those heads asked for) |
//   o | norm (thread 0) | gate_up | silu (thread 0) | down
// with a barrier after each. Shares are at::parallel_for's split (equal runs of tiles, the last shorter), and
// each kernel's own parallel_for runs inline on its thread inside the region. An adapter-wrapped projection's
// update runs in the same phase, with no barrier of its own: the thread runs its share of the shrink into the
// shared h, its matmul share, waits (at a counter, almost never in vain; yielding, for more threads than cores)
// for the other shares of h, then runs the expand over the columns it just wrote. Every output element is
// computed the same way whichever thread computes it, so results are the kernels' own, bit for bit. The adapters'
// plans are made before the region (their checks may throw); an error inside it stops the work but not the
// barriers, and is rethrown after the region.
void DecodeStack::layers_one_row(const StepBuffers& b, const StepInputs& in) const {
#if defined(_OPENMP)
  RECORD_FUNCTION("pagedllm::decode_one_row", std::vector<c10::IValue>());   // torch.profiler names the path
  const size_t num_layers = layers_.size();
  // Projection n of the step: [layer][qkv, o, gate_up, down], in their order.
  auto projection_at = [&](size_t n) -> const Projection& {
    const DecodeLayer& layer = layers_[n / 4];
    const Projection* in_layer[] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    return *in_layer[n % 4];
  };
  // Projection n's adapter update (none where updates[n] is empty, and no updates on a step without adapter rows).
  std::vector<std::optional<LoRAUpdate>> updates(in.lora == nullptr ? 0 : 4 * num_layers);   // made in place
  int64_t h_size = 0;   // the largest update's h, shared by the threads
  if (in.lora != nullptr) {   // made serially before the region, every step
    RECORD_FUNCTION("pagedllm::decode_lora_plans", std::vector<c10::IValue>());   // the plans' cost, apart
    for (size_t i = 0; i < num_layers; ++i) {
      const std::pair<const at::Tensor*, const at::Tensor*> out_x[] = {
          {&b.qkv, &b.normed}, {&b.projected, &b.attention}, {&b.gate_up, &b.normed}, {&b.out, &b.activated}};
      for (size_t p = 0; p < 4; ++p) {
        const Projection& projection = projection_at(4 * i + p);
        if (!projection.lora) continue;
        std::optional<LoRAUpdate>& update = updates[4 * i + p];
        update.emplace(*out_x[p].first, *out_x[p].second, projection.lora->weights, *in.lora);
        if (update->empty()) {
          update.reset();
          continue;
        }
        h_size = std::max(h_size, update->h_size());
      }
    }
  }
  const int64_t group = num_heads_ / num_kv_heads_;
  std::vector<float> h(h_size);
  // Shrink shares put in h so far, over all threads and projections: an update's expand waits for its
  // projection's shares at this counter, not at a barrier, as the other thread's share was done before its
  // share of the matmul (the wait is almost never a wait).
  std::atomic<int64_t> shrinks_done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    auto share = [&](int64_t total) {   // at::parallel_for's split: equal runs, the last one shorter
      const int64_t chunk = (total + threads - 1) / threads;
      return std::make_pair(std::min(total, thread * chunk), std::min(total, (thread + 1) * chunk));
    };
    // Projection n's output columns this thread writes: those of its share of the weight's tiles.
    auto columns = [&](size_t n) {
      const Projection& p = projection_at(n);
      const auto [first_tile, last_tile] = share(p.qweight.size(0));
      return std::make_pair(first_tile * kTileRows, std::min(p.out_features, last_tile * kTileRows));
    };
    auto guarded = [&](auto&& work) {   // the work unless a thread failed; a failure kept for after the region
      if (failed.load(std::memory_order_relaxed)) return;
      try {
        work();
      } catch (...) {
#pragma omp critical(pagedllm_decode_one_row)
        if (!error) error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
      }
    };
    auto on_one_thread = [&](auto&& work) {
      if (thread == 0) guarded(work);
#pragma omp barrier
    };
    int64_t adapter_projections = 0;   // projections with an update so far, the same count on every thread
    auto project = [&](const at::Tensor& out, const at::Tensor& x, size_t n) {   // projection n of the step
      const Projection& p = projection_at(n);
      const LoRAUpdate* update = n < updates.size() && updates[n] ? &*updates[n] : nullptr;
      const auto [first_tile, last_tile] = share(p.qweight.size(0));
      if (update != nullptr) {
        const auto [first, last] = share(update->num_shrinks());
        guarded([&] { update->shrink_tasks(h.data(), first, last); });
        shrinks_done.fetch_add(1, std::memory_order_release);   // even after a failure: no thread waits for ever
        ++adapter_projections;
      }
      guarded([&] { in.share(out, x, p.qweight, p.scales, p.mins, p.bias, p.bits, p.group, first_tile, last_tile); });
      if (update != nullptr) {
        while (shrinks_done.load(std::memory_order_acquire) < threads * adapter_projections) std::this_thread::yield();
        guarded([&] {
          const auto [begin, end] = columns(n);
          update->expand_from(h.data(), begin, end);
        });
      }
#pragma omp barrier
    };
    // This thread's kv heads, and the views of its query and key heads.
    const auto [kv_first, kv_end] = share(num_kv_heads_);
    at::Tensor q_mine, k_mine;
    guarded([&] {
      q_mine = b.q_rotated.narrow(1, kv_first * group, (kv_end - kv_first) * group);
      k_mine = b.k_rotated.narrow(1, kv_first, kv_end - kv_first);
    });

    // Layer n's K and V of this thread's kv heads, asked for a layer ahead: the attention phase reads ~50 KB a kv
    // head at a few hundred keys from blocks anywhere in the cache, which the layer's matmuls (reading their weights
    // at memory speed) have pushed out of the caches, so fetched only as the walk reaches them its reads waited on
    // memory (a kv head at 192 keys: ~11 us against ~3 in cache). Asked for as the previous layer's attention ends,
    // they arrive while its o, gate_up and down projections run; layer 0's, before its first norm.
    auto prefetch_own_kv = [&](size_t n) {
      prefetch_kv_heads(in.k_caches[n], in.v_caches[n], in.k_scales[n], in.v_scales[n], in.block_tables,
                        in.token_rows, in.seq_lens, layers_[n].sliding_window, kv_first, kv_end);
    };
    guarded([&] { prefetch_own_kv(0); });

    for (size_t i = 0; i < num_layers; ++i) {
      const DecodeLayer& layer = layers_[i];
      on_one_thread([&] {
        if (i == 0) {
          rms_norm(b.normed, b.residual, layer.input_norm, eps_);
        } else {
          add_rms_norm(b.normed, b.residual, b.out, layer.input_norm, eps_);
        }
      });
      project(b.qkv, b.normed, 4 * i);
      guarded([&] {
        if (kv_first == kv_end) return;
        rotary_embedding(q_mine, in.rope_rows, in.cos_sin);
        rotary_embedding(k_mine, in.rope_rows, in.cos_sin);
        write_kv_heads(in.k_caches[i], in.v_caches[i], in.k_scales[i], in.v_scales[i], b.k, b.v, in.slot_mapping,
                       kv_first, kv_end);
        paged_attention_heads(b.attention_heads, b.q, in.k_caches[i], in.v_caches[i], in.k_scales[i],
                              in.v_scales[i], in.block_tables, in.token_rows, in.seq_lens, layer.scale,
                              layer.sliding_window, layer.logit_softcap, kv_first, kv_end);
        if (i + 1 < num_layers) prefetch_own_kv(i + 1);
      });
#pragma omp barrier
      project(b.projected, b.attention, 4 * i + 1);
      on_one_thread([&] { add_rms_norm(b.normed, b.residual, b.projected, layer.post_attention_norm, eps_); });
      project(b.gate_up, b.normed, 4 * i + 2);
      on_one_thread([&] { silu_and_mul(b.activated, b.gate_up); });
      project(b.out, b.activated, 4 * i + 3);
    }
  }
  if (error) std::rethrow_exception(error);
#else
  layers_in_turn(b, in);
#endif
}

DecodeStack::DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, double eps)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), rotary_dim_(rotary_dim), eps_(eps) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "DecodeStack: num_heads must be a positive multiple of num_kv_heads");
  TORCH_CHECK(rotary_dim > 0 && rotary_dim <= head_dim, "DecodeStack: rotary_dim must be in 1..head_dim");
}

void DecodeStack::add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, ProjectionArgs qkv,
                            int64_t qkv_out, ProjectionArgs o, int64_t o_out, ProjectionArgs gate_up,
                            int64_t gate_up_out, ProjectionArgs down, int64_t down_out, double scale,
                            int64_t sliding_window, double logit_softcap) {
  const int64_t hidden = input_norm.numel();
  TORCH_CHECK(post_attention_norm.numel() == hidden && qkv_out == (num_heads_ + 2 * num_kv_heads_) * head_dim_ &&
                  o_out == hidden && down_out == hidden && gate_up_out % 2 == 0,
              "DecodeStack.add_layer: shapes do not make a decoder layer of this stack's heads");
  DecodeLayer layer{input_norm, post_attention_norm, projection(qkv, qkv_out), projection(o, o_out),
                    projection(gate_up, gate_up_out), projection(down, down_out), scale, sliding_window,
                    logit_softcap};
  if (!layers_.empty()) {
    const DecodeLayer& first = layers_.front();
    TORCH_CHECK(first.input_norm.numel() == hidden && first.gate_up.out_features == gate_up_out &&
                    first.input_norm.scalar_type() == input_norm.scalar_type(),
                "DecodeStack.add_layer: every layer must have the first one's shapes and dtype");
  }
  layers_.push_back(std::move(layer));
}

void DecodeStack::set_lora(int64_t layer, int64_t projection, at::Tensor a, at::Tensor b, at::Tensor ranks,
                           at::Tensor column_starts) {
  TORCH_CHECK(layer >= 0 && layer < num_layers() && projection >= 0 && projection < 4,
              "DecodeStack.set_lora: layer must be in 0..", num_layers() - 1, " and projection in 0..3");
  DecodeLayer& target = layers_[layer];
  Projection* projections[] = {&target.qkv, &target.o, &target.gate_up, &target.down};
  TORCH_CHECK(b.dim() == 3 && b.size(2) == projections[projection]->out_features,
              "DecodeStack.set_lora: b must be [slots, max_rank, the projection's out_features]");
  projections[projection]->lora = LoRASlots{a, b, ranks, column_starts, LoRAWeights(a, b, ranks, column_starts)};
}

std::tuple<at::Tensor, at::Tensor> DecodeStack::forward(
    at::Tensor hidden, at::Tensor rope_rows, at::Tensor cos_sin, at::Tensor slot_mapping, at::Tensor block_tables,
    at::Tensor token_rows, at::Tensor seq_lens, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
    std::vector<std::optional<at::Tensor>> k_scales, std::vector<std::optional<at::Tensor>> v_scales,
    const std::string& path, std::optional<at::Tensor> lora_rows, std::optional<at::Tensor> lora_segments) const {
  RECORD_FUNCTION("pagedllm::decode_layers", std::vector<c10::IValue>({hidden}));   // torch.profiler names it
  const size_t num_layers = layers_.size();
  TORCH_CHECK(num_layers > 0, "DecodeStack.forward: no layers");
  TORCH_CHECK(k_caches.size() == num_layers && v_caches.size() == num_layers && k_scales.size() == num_layers &&
                  v_scales.size() == num_layers,
              "DecodeStack.forward: one K and V cache (and scales) per layer");
  const DecodeLayer& shape = layers_.front();
  const int64_t tokens = hidden.size(0), size = shape.input_norm.numel();
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == size && hidden.is_contiguous() &&
                  hidden.scalar_type() == shape.input_norm.scalar_type(),
              "DecodeStack.forward: hidden must be contiguous [tokens, ", size, "] in the weights' dtype");
  TORCH_CHECK(slot_mapping.size(0) == tokens && seq_lens.size(0) == tokens && token_rows.size(0) == tokens,
              "DecodeStack.forward: one slot, sequence length and block-table row per token");
  const Matmul matmul = matmul_for(path);
  TORCH_CHECK(lora_rows.has_value() == lora_segments.has_value(),
              "DecodeStack.forward: lora_rows and lora_segments come together");
  std::optional<LoRARowGroups> lora_step;   // checked once for every projection's update
  if (lora_rows) lora_step.emplace(*lora_rows, *lora_segments, tokens);
  const LoRARowGroups* lora = lora_step ? &*lora_step : nullptr;

  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  auto buffer = [&](int64_t columns) { return at::empty({tokens, columns}, hidden.options()); };
  StepBuffers b;
  b.residual = hidden;
  b.normed = buffer(size);
  b.qkv = buffer(shape.qkv.out_features);
  b.attention = buffer(q_size);
  b.projected = buffer(size);
  b.gate_up = buffer(shape.gate_up.out_features);
  b.activated = buffer(shape.gate_up.out_features / 2);
  b.out = buffer(size);
  b.q = b.qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
  b.k = b.qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
  b.v = b.qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
  const bool partial_rotary = rotary_dim_ < head_dim_;
  b.q_rotated = partial_rotary ? b.q.narrow(2, 0, rotary_dim_) : b.q;
  b.k_rotated = partial_rotary ? b.k.narrow(2, 0, rotary_dim_) : b.k;
  b.attention_heads = b.attention.view({tokens, num_heads_, head_dim_});

  const StepInputs in{rope_rows, cos_sin, slot_mapping, block_tables, token_rows, seq_lens, k_caches, v_caches,
                      k_scales, v_scales, matmul, share_for(path), lora};
  if (tokens == 1 && in.share != nullptr) {
    layers_one_row(b, in);
  } else {
    layers_in_turn(b, in);
  }
  return {b.out, b.residual};
}

}  // namespace pagedllm
