// A decode step's decoder layers as one call (decode_layers.cpp): the same kernels the Python layers call,
// in the same order on the same inputs (so the same results, bit for bit), without a Python call, a module
// boundary or a new output tensor between them. pagedllm/model/decode_stack.py says when it serves.
#pragma once

#include "lora_sgmv.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pagedllm {

// A group-quantized projection (quant_format.h): qweight, scales, mins (None: symmetric), bias (None: none),
// bits, group size. out = x @ weight^T (+ bias), in x's dtype.
using ProjectionArgs = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                                  int64_t, int64_t>;

// An adapter-wrapped projection's adapter slots (pagedllm/lora/punica.py StackedLoRA, updated in place as adapters
// become resident): lora_sgmv adds each row's update to the projection's output, as the Python LoRALinear does.
// The tensors are held here; `weights` views them, checked once.
struct LoRASlots {
  at::Tensor a, b, ranks, column_starts;
  LoRAWeights weights;
};

struct Projection {
  at::Tensor qweight, scales;
  std::optional<at::Tensor> mins, bias;
  int64_t bits, group, out_features;
  std::optional<LoRASlots> lora;   // None: no adapter wrapper
};

struct DecodeLayer {
  at::Tensor input_norm, post_attention_norm;   // RMSNorm weights
  Projection qkv, o, gate_up, down;
  double scale;            // attention's score scale
  int64_t sliding_window;  // 0: none
  double logit_softcap;    // 0: none
};

// A Llama-shaped stack: RMSNorm -> fused qkv -> rope on q and k -> K/V written -> paged attention -> o ->
// residual add + RMSNorm -> fused gate_up -> silu(gate) * up -> down, every layer of one shape.
struct StepBuffers;
struct StepInputs;

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, double eps);

  // Appends a layer; its shapes must match the first one's. out_features: each projection's output columns.
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, ProjectionArgs qkv, int64_t qkv_out,
                 ProjectionArgs o, int64_t o_out, ProjectionArgs gate_up, int64_t gate_up_out, ProjectionArgs down,
                 int64_t down_out, double scale, int64_t sliding_window, double logit_softcap);

  // Gives projection `projection` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer` its adapter slots.
  void set_lora(int64_t layer, int64_t projection, at::Tensor a, at::Tensor b, at::Tensor ranks,
                at::Tensor column_starts);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden: [tokens, hidden] the embeddings of a step of decodes only (token i is block-table row i). Runs
  // every layer and returns (the last layer's output, the residual stream before it), as the Python layers do;
  // hidden becomes the residual stream (added to in place). rope_rows / cos_sin: the step's Rotation;
  // slot_mapping, block_tables, seq_lens: the step's decode metadata; one cache (and int8 scales) per layer.
  // path: the quantized matmul kernel for this row count (quantized_matmul.py's PATHS but torch). lora_rows /
  // lora_segments: the step's rows grouped by adapter slot (lora_sgmv's rows and segments; None: no adapter rows).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, at::Tensor rope_rows, at::Tensor cos_sin,
                                             at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor token_rows,
                                             at::Tensor seq_lens, std::vector<at::Tensor> k_caches,
                                             std::vector<at::Tensor> v_caches,
                                             std::vector<std::optional<at::Tensor>> k_scales,
                                             std::vector<std::optional<at::Tensor>> v_scales,
                                             const std::string& path, std::optional<at::Tensor> lora_rows,
                                             std::optional<at::Tensor> lora_segments) const;

 private:
  // The layers of a step of several rows (or a path other than rows): each kernel over the cores in turn.
  void layers_in_turn(const StepBuffers& buffers, const StepInputs& in) const;
  // The layers of a one-row step on a path with a one-thread share (rows, int16) in one parallel region
  // (decode_layers.cpp says why).
  void layers_one_row(const StepBuffers& buffers, const StepInputs& in) const;

  int64_t num_heads_, num_kv_heads_, head_dim_, rotary_dim_;
  double eps_;
  std::vector<DecodeLayer> layers_;
};

}  // namespace pagedllm
