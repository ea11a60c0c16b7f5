// A decode step's decoder layers in one call. Batch-1 decode of a 30-layer model spent ~3.4 ms a step in
// Python between its ~11 kernels per layer (module calls, pybind conversions, an output tensor per op, views
// and splits of qkv): here the kernels run back to back on buffers made once per step and views made once.
#include "decode_layers.h"

#include "lora_sgmv.h"
#include "ops.h"
#include "quant_format.h"

#include <ATen/record_function.h>

#include <exception>
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
  TORCH_CHECK(false, "decode_layers: path must be rows, brgemm or int8, got ", path);
}

Projection projection(const ProjectionArgs& args, int64_t out_features) {
  const auto& [qweight, scales, mins, bias, bits, group] = args;
  return {qweight, scales, mins, bias, bits, group, out_features, std::nullopt};
}

// The step's rows with an adapter, grouped by slot (lora_sgmv's rows and segments).
struct LoRARows {
  at::Tensor rows, segments;
};

// A one-row step's projection and its adapter update in ONE parallel region: each thread runs its share of the
// shrink, the matmul over its share of the weight's tiles (split as the matmul's own parallel_for splits them; its
// parallel_for runs inline here), and, after a barrier (the expand needs all of h), the expand over the output
// columns it just wrote. Apart, the matmul and lora_sgmv's shrink and expand were three fork/joins of the threads,
// 360 a step on a 30-layer model with an adapter on every projection. Results are the separate calls' bit for bit:
// each output column is computed the same way whichever thread computes it. x: one row; out: [1, out_features].
void run_one_row(Matmul matmul, const at::Tensor& out, const at::Tensor& x, const Projection& p, LoRAUpdate& update) {
#if defined(_OPENMP)
  const int64_t tiles = p.qweight.size(0);
  std::exception_ptr error;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    auto share = [&](int64_t total) {   // at::parallel_for's split: equal runs, the last one shorter
      const int64_t chunk = (total + threads - 1) / threads;
      return std::make_pair(std::min(total, thread * chunk), std::min(total, (thread + 1) * chunk));
    };
    const auto [first_tile, last_tile] = share(tiles);
    const int64_t begin = first_tile * kTileRows, end = std::min(p.out_features, last_tile * kTileRows);
    try {
      const auto [first_shrink, last_shrink] = share(update.num_shrinks());
      update.shrink(first_shrink, last_shrink);
      if (first_tile < last_tile) {
        auto tiles_of = [&](const at::Tensor& t) { return t.narrow(0, first_tile, last_tile - first_tile); };
        matmul(out.narrow(1, begin, end - begin), x, tiles_of(p.qweight), tiles_of(p.scales),
               p.mins ? std::optional<at::Tensor>(tiles_of(*p.mins)) : std::nullopt,
               p.bias ? std::optional<at::Tensor>(p.bias->narrow(0, begin, end - begin)) : std::nullopt, p.bits,
               p.group);
      }
    } catch (...) {
#pragma omp critical(pagedllm_run_one_row)
      if (!error) error = std::current_exception();
    }
#pragma omp barrier
    if (!error) {
      try {
        update.expand(begin, end);
      } catch (...) {
#pragma omp critical(pagedllm_run_one_row)
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
#else
  matmul(out, x, p.qweight, p.scales, p.mins, p.bias, p.bits, p.group);
  update.run();
#endif
}

// out = x . projection, plus each adapter row's update where the projection has adapter slots: the Python
// LoRALinear's two kernels, in its order (one row: both in one parallel region, run_one_row).
void run(Matmul matmul, const at::Tensor& out, const at::Tensor& x, const Projection& p, const LoRARows* lora) {
  if (lora == nullptr || !p.lora) {
    matmul(out, x, p.qweight, p.scales, p.mins, p.bias, p.bits, p.group);
    return;
  }
  const LoRASlots& slots = *p.lora;
  LoRAUpdate update(out, x, slots.a, slots.b, slots.ranks, slots.column_starts, lora->rows, lora->segments);
  if (update.empty()) {
    matmul(out, x, p.qweight, p.scales, p.mins, p.bias, p.bits, p.group);
  } else if (x.size(0) == 1) {
    RECORD_FUNCTION("pagedllm::lora_projection", std::vector<c10::IValue>({out}));   // torch.profiler names it
    run_one_row(matmul, out, x, p, update);
  } else {
    matmul(out, x, p.qweight, p.scales, p.mins, p.bias, p.bits, p.group);
    RECORD_FUNCTION("pagedllm::lora_sgmv", std::vector<c10::IValue>({out}));   // as lora_sgmv labels it
    update.run();
  }
}

}  // namespace

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
  projections[projection]->lora = LoRASlots{a, b, ranks, column_starts};
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
  const std::optional<LoRARows> lora_step =
      lora_rows ? std::optional<LoRARows>(LoRARows{*lora_rows, *lora_segments}) : std::nullopt;
  const LoRARows* lora = lora_step ? &*lora_step : nullptr;

  // The step's buffers, reused by every layer, and their views.
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  auto buffer = [&](int64_t columns) { return at::empty({tokens, columns}, hidden.options()); };
  const at::Tensor normed = buffer(size), qkv = buffer(shape.qkv.out_features), attention = buffer(q_size),
                   projected = buffer(size), gate_up = buffer(shape.gate_up.out_features),
                   activated = buffer(shape.gate_up.out_features / 2), out = buffer(size);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
  const bool partial_rotary = rotary_dim_ < head_dim_;
  const at::Tensor q_rotated = partial_rotary ? q.narrow(2, 0, rotary_dim_) : q;
  const at::Tensor k_rotated = partial_rotary ? k.narrow(2, 0, rotary_dim_) : k;
  const at::Tensor attention_heads = attention.view({tokens, num_heads_, head_dim_});

  const at::Tensor residual = hidden;
  for (size_t i = 0; i < num_layers; ++i) {
    const DecodeLayer& layer = layers_[i];
    if (i == 0) {
      rms_norm(normed, hidden, layer.input_norm, eps_);
    } else {   // the residual stream takes the previous layer's output, and is normalised
      add_rms_norm(normed, residual, out, layer.input_norm, eps_);
    }
    run(matmul, qkv, normed, layer.qkv, lora);
    rotary_embedding(q_rotated, rope_rows, cos_sin);
    rotary_embedding(k_rotated, rope_rows, cos_sin);
    write_kv(k_caches[i], v_caches[i], k_scales[i], v_scales[i], k, v, slot_mapping);
    {
      RECORD_FUNCTION("pagedllm::decode_attention", std::vector<c10::IValue>());   // as the Python layers label it
      paged_attention(attention_heads, q, k_caches[i], v_caches[i], k_scales[i], v_scales[i], block_tables,
                      token_rows, seq_lens, layer.scale, layer.sliding_window, layer.logit_softcap);
    }
    run(matmul, projected, attention, layer.o, lora);
    add_rms_norm(normed, residual, projected, layer.post_attention_norm, eps_);
    run(matmul, gate_up, normed, layer.gate_up, lora);
    silu_and_mul(activated, gate_up);
    run(matmul, out, activated, layer.down, lora);
  }
  return {out, residual};
}

}  // namespace pagedllm
