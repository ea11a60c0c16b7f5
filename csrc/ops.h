// The CPU kernels pagedllm._C exports (see bindings.cpp). Each Python caller keeps the
// PyTorch formula a kernel replaces, which serves where the extension is not built.
#pragma once

// ATen only: torch/extension.h (the C++ frontend and pybind11) costs every file tens of seconds of
// compile; bindings.cpp alone includes it.
#include <ATen/ATen.h>

#include <optional>

// Caches as csrc/paged_cache.h lays them out: k_cache [blocks, kv_heads, head_dim, block_size],
// v_cache [blocks, kv_heads, block_size, head_dim], in the model dtype or a KV cache dtype
// (bfloat16, float16, float8_e5m2, int8); k_scales, v_scales: [blocks, kv_heads, block_size]
// float32 for int8 caches, None otherwise.

// out, q: [tokens, heads, head_dim] (q's tokens may be strided, e.g. rows of qkv); block_tables:
// [rows, max_blocks] int64; token_rows[i]: the block-table row of token i; kv_lens[i]: how many
// keys token i attends to (its position + 1). sliding_window > 0: a token sees only its last
// sliding_window keys (itself included); logit_softcap > 0: scaled scores become cap * tanh(score / cap).
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     std::optional<at::Tensor> k_scales, std::optional<at::Tensor> v_scales,
                     at::Tensor block_tables, at::Tensor token_rows, at::Tensor kv_lens, double scale,
                     int64_t sliding_window, double logit_softcap);
// paged_attention's output for kv heads [kv_first, kv_end) (and their query heads) of every token, on the calling
// thread alone: one thread's share, each head's result as paged_attention computes it.
void paged_attention_heads(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scales,
                           const std::optional<at::Tensor>& v_scales, const at::Tensor& block_tables,
                           const at::Tensor& token_rows, const at::Tensor& kv_lens, double scale,
                           int64_t sliding_window, double logit_softcap, int64_t kv_first, int64_t kv_end);

// Asks the caches for the K and V (and int8 scales) that paged_attention_heads would read for kv heads
// [kv_first, kv_end) of every token, and returns without waiting for them: the compiled decode stack's one-row
// step asks for a layer's while the layer before it computes (decode_layers.cpp says why).
void prefetch_kv_heads(const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scales,
                       const std::optional<at::Tensor>& v_scales, const at::Tensor& block_tables,
                       const at::Tensor& token_rows, const at::Tensor& kv_lens, int64_t sliding_window,
                       int64_t kv_first, int64_t kv_end);

// Prefill chunks: out, q as above; chunk c's query tokens are rows [query_starts[c], query_starts[c + 1])
// at positions context_lens[c] onwards, its keys (all in the cache already) reached through
// block_tables[c]; each token attends causally to its sequence's keys up to its own position (within
// the window, sliding_window and logit_softcap as paged_attention's).
void prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                       std::optional<at::Tensor> k_scales, std::optional<at::Tensor> v_scales,
                       at::Tensor block_tables, at::Tensor query_starts, at::Tensor context_lens, double scale,
                       int64_t sliding_window, double logit_softcap);
// The same with the tile products as oneDNN brgemm calls: bfloat16 queries and cache (AMX where the CPU has it,
// AVX512-BF16 elsewhere), or float queries over a float or bfloat16 cache.
void prefill_attention_brgemm(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              std::optional<at::Tensor> k_scales, std::optional<at::Tensor> v_scales,
                              at::Tensor block_tables, at::Tensor query_starts, at::Tensor context_lens, double scale,
                              int64_t sliding_window, double logit_softcap);

// Shared-prefix attention, sequences shaped as prefill_attention's chunks (a decode is a chunk of one
// token): group g is the sequences group_seqs[group_starts[g] : group_starts[g + 1]], whose block tables
// agree on the blocks holding their first shared_lens[g] keys (<= every member's context_lens); its
// query rows read those once, together, then each sequence its keys after them. Sequences in no group
// attend to all their keys. The result equals prefill_attention's (no sliding window; logit_softcap as there).
void cascade_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                       std::optional<at::Tensor> k_scales, std::optional<at::Tensor> v_scales,
                       at::Tensor block_tables, at::Tensor query_starts, at::Tensor context_lens,
                       at::Tensor group_seqs, at::Tensor group_starts, at::Tensor shared_lens, double scale,
                       double logit_softcap);

// k, v: [tokens, kv_heads, head_dim] (rows may be strided) stored at flat slots of the caches, in
// their dtype (rounded to nearest even; int8 quantized per slot and kv head, see paged_cache.h).
void write_kv(at::Tensor k_cache, at::Tensor v_cache, std::optional<at::Tensor> k_scales,
              std::optional<at::Tensor> v_scales, at::Tensor k, at::Tensor v, at::Tensor slot_mapping);
// The same for kv heads [kv_first, kv_end) only, on the calling thread alone (one thread's share).
void write_kv_heads(const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scales,
                    const std::optional<at::Tensor>& v_scales, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping, int64_t kv_first, int64_t kv_end);

// out = weight * (x / rms(x)), row by row; x: [tokens, hidden].
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);

// residual += x, then out = rms_norm(residual): the residual stream and the next norm in one pass.
void add_rms_norm(at::Tensor out, at::Tensor residual, at::Tensor x, at::Tensor weight, double eps);

// Rotates x: [tokens, heads, head_dim] (rows may be strided) in place by the rotate-half rule;
// cos_sin: [positions, head_dim] float32, cos in the first half, sin in the second.
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos_sin);

// out = silu(gate) * up, with gate_up = [gate | up]: [tokens, 2 * size].
void silu_and_mul(at::Tensor out, at::Tensor gate_up);

// Per row of float32 logits [rows, vocab]: log sum exp (the log-softmax normaliser) and the
// argmax (first position of the maximum, as torch.argmax). Logits must not hold NaN.
void logits_summary(at::Tensor log_normaliser, at::Tensor best, at::Tensor logits);

// Sets to -inf, in float32 logits [rows, vocab] row logits_rows[i], every token that bitmask [n, ceil(vocab / 32)]
// int32 row i disallows (bit b of word w is token 32w + b, 1 = allowed; xgrammar's layout).
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor logits_rows);

// Per row of float32 logits [rows, vocab], into best (int64 [rows]): the argmax of the row as logit controls leave it,
// without changing it: the tokens bitmask row bitmask_index[r] disallows read as -inf (-1: no mask), and
// change_values[j] (a bias, or -inf for a ban) is added to token change_ids[j] for j in
// [change_starts[r], change_starts[r + 1]). The row is restored before the call returns.
void controlled_argmax(at::Tensor best, at::Tensor logits, at::Tensor bitmask, at::Tensor bitmask_index,
                       at::Tensor change_starts, at::Tensor change_ids, at::Tensor change_values);

// Top-k, then top-p, in place on float32 logits [rows, vocab] (temperature applied): the tokens they drop to -inf,
// the same set the full sort in worker/sampler.py drops. top_k: int64 [rows] (vocab where off); top_p: float32
// [rows] (1 or more where off); either may be None. Logits must not hold NaN or +inf.
void truncate_top_k_top_p(at::Tensor logits, std::optional<at::Tensor> top_k, std::optional<at::Tensor> top_p);

// Group-quantized weights (formats in quant_format.h): out [rows, out_features] = x [rows, cols] @ weight^T (+ bias).
// _rows: float activations against weights dequantized in registers, up to 8 rows per pass over the weights
// (few rows; each row's result independent of the others). _brgemm: blocks of weights dequantized to x's
// dtype (bfloat16 or float32) and multiplied by oneDNN's brgemm micro-kernel (many rows). _int8: x quantized
// to int8 per row and group, integer dot products (the opt-in activation_dtype="int8").
void quantized_linear_rows(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                           c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group);
void quantized_linear_brgemm(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                             c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group);
void quantized_linear_int8(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                           c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group);
// _int8_tiles: _int8's sums, bitwise, register-blocked for many rows (weights unpacked once per call; VNNI builds,
// elsewhere it is _int8).
void quantized_linear_int8_tiles(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                                 c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits,
                                 int64_t group);
// _int16: activations quantized to int16 per row and group, integer products (vpmaddwd on AVX2); a row's result
// does not depend on the rows it shares the call with.
void quantized_linear_int16(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales,
                            c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t bits, int64_t group);
// quantized_linear_rows's output tiles [first_tile, last_tile) (columns 16 * first_tile onwards) on the calling
// thread alone: one thread's share, for a caller that already runs on every core (the compiled decode stack's
// one-row step). Each column comes out as quantized_linear_rows computes it.
void quantized_linear_rows_share(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                                 const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                 const c10::optional<at::Tensor>& bias, int64_t bits, int64_t group,
                                 int64_t first_tile, int64_t last_tile);
// The same for quantized_linear_int16 (each column as quantized_linear_int16 computes it).
void quantized_linear_int16_share(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                                  const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                  const c10::optional<at::Tensor>& bias, int64_t bits, int64_t group,
                                  int64_t first_tile, int64_t last_tile);

// The weight as floats: out [rows, cols] = scale * q + min, exactly as gguf's dequantization computes it; with
// `rows` (int64 weight row ids) only those rows, out[i] = row rows[i] (an embedding lookup).
void dequantize(at::Tensor out, at::Tensor qweight, at::Tensor scales, c10::optional<at::Tensor> mins,
                int64_t bits, int64_t group, c10::optional<at::Tensor> rows);

// One layer's LoRA update for a step (lora_sgmv.cpp): out[rows[i]] += x[rows[i]] . A . B with the A and B of the
// slot of the segment (slot, start, end) in `segments` holding position i; rows in no segment are left alone.
// a [slots, parts * max_rank, in]: part p's A in rows p * max_rank onwards; b [slots, max_rank, out]: column c
// holds the B of the part that owns c (columns column_starts[p] to column_starts[p + 1]); ranks [slots, parts]:
// each part's rank (0: no update). x, out: [rows, in], [rows, out] in one dtype; a, b float32/bfloat16/float16.
void lora_sgmv(at::Tensor out, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks, at::Tensor column_starts,
               at::Tensor rows, at::Tensor segments);
