#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over KV blocks, decode tokens (CPU)");
  m.def("prefill_attention", &prefill_attention, "Paged causal attention for prefill chunks (CPU)");
  m.def("write_kv", &write_kv, "Store new K/V rows at their cache slots (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "Residual add, then RMSNorm (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "Rotary position embedding in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU)");
  m.def("logits_summary", &logits_summary, "Per-row logsumexp and argmax of float32 logits (CPU)");
}
