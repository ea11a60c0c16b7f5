#include <torch/extension.h>

#include "decode_layers.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  // sliding_window 0 and logit_softcap 0: neither (most models).
  m.def("paged_attention", &paged_attention, "Paged attention over KV blocks, decode tokens (CPU)", arg("out"),
        arg("q"), arg("k_cache"), arg("v_cache"), arg("k_scales"), arg("v_scales"), arg("block_tables"),
        arg("token_rows"), arg("kv_lens"), arg("scale"), arg("sliding_window") = 0, arg("logit_softcap") = 0.0);
  m.def("prefill_attention", &prefill_attention, "Paged causal attention for prefill chunks (CPU)", arg("out"),
        arg("q"), arg("k_cache"), arg("v_cache"), arg("k_scales"), arg("v_scales"), arg("block_tables"),
        arg("query_starts"), arg("context_lens"), arg("scale"), arg("sliding_window") = 0,
        arg("logit_softcap") = 0.0);
  m.def("prefill_attention_brgemm", &prefill_attention_brgemm,
        "Paged causal attention for prefill chunks, tile products through oneDNN brgemm (CPU, bfloat16 or float)",
        arg("out"), arg("q"), arg("k_cache"), arg("v_cache"), arg("k_scales"), arg("v_scales"), arg("block_tables"),
        arg("query_starts"), arg("context_lens"), arg("scale"), arg("sliding_window") = 0,
        arg("logit_softcap") = 0.0);
  m.def("cascade_attention", &cascade_attention, "Paged attention reading shared prefix blocks once per group (CPU)",
        arg("out"), arg("q"), arg("k_cache"), arg("v_cache"), arg("k_scales"), arg("v_scales"), arg("block_tables"),
        arg("query_starts"), arg("context_lens"), arg("group_seqs"), arg("group_starts"), arg("shared_lens"),
        arg("scale"), arg("logit_softcap") = 0.0);
  m.def("write_kv", &write_kv, "Store new K/V rows at their cache slots (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "Residual add, then RMSNorm (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "Rotary position embedding in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU)");
  m.def("dequantize", &dequantize, "Group-quantized weights to floats, all rows or the given ones (CPU)", arg("out"),
        arg("qweight"), arg("scales"), arg("mins"), arg("bits"), arg("group"), arg("rows") = pybind11::none());
  m.def("logits_summary", &logits_summary, "Per-row logsumexp and argmax of float32 logits (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "Disallowed tokens of a packed bitmask to -inf, in place (CPU)");
  m.def("controlled_argmax", &controlled_argmax, "Argmax of rows under logit controls, without a copy (CPU)");
  m.def("truncate_top_k_top_p", &truncate_top_k_top_p, "Top-k then top-p to -inf, in place, without a sort (CPU)",
        arg("logits"), arg("top_k"), arg("top_p"));
  // Quantized matmuls (quant_matmul.cpp, quant_linear.cpp).
  m.def("quantized_linear_rows", &quantized_linear_rows, "Quantized linear, float activations, few rows (CPU)");
  m.def("quantized_linear_brgemm", &quantized_linear_brgemm, "Quantized linear, dequantized tiles through oneDNN brgemm (CPU)");
  m.def("quantized_linear_int8", &quantized_linear_int8, "Quantized linear, int8 activations and dot products (CPU)");
  m.def("quantized_linear_int8_tiles", &quantized_linear_int8_tiles, "Quantized linear, int8 activations, many rows (CPU)");
  m.def("quantized_linear_int16", &quantized_linear_int16, "Quantized linear, int16 activations and integer products (CPU)");
  // One layer's LoRA update for a whole step (lora_sgmv.cpp).
  m.def("lora_sgmv", &lora_sgmv, "One layer's LoRA update of a step, rows grouped by adapter slot (CPU)", arg("out"),
        arg("x"), arg("a"), arg("b"), arg("ranks"), arg("column_starts"), arg("rows"), arg("segments"));
  // A decode step's decoder layers in one call (decode_layers.cpp; pagedllm/model/decode_stack.py).
  pybind11::class_<pagedllm::DecodeStack>(m, "DecodeStack", pybind11::module_local())   // one per variant
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double>(), arg("num_heads"), arg("num_kv_heads"),
           arg("head_dim"), arg("rotary_dim"), arg("eps"))
      .def("add_layer", &pagedllm::DecodeStack::add_layer)
      .def("set_lora", &pagedllm::DecodeStack::set_lora)
      .def("forward", &pagedllm::DecodeStack::forward)
      .def_property_readonly("num_layers", &pagedllm::DecodeStack::num_layers);
}
