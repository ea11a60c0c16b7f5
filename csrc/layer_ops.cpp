// The element-wise parts of a decoder layer, each one pass over memory: PyTorch runs them
// as chains of small ops (RMSNorm alone is seven), each reading and writing the whole
// activation, and at decode batch sizes each op costs more in dispatch than in arithmetic.
// Roundings follow Hugging Face's formulas where they round to the model dtype mid-way.
#include "ops.h"
#include "paged_cache.h"
#include "vectors.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>

namespace {

using namespace pagedllm;

// Rows per task so that a thread's share (~32k elements) outweighs waking it.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elements)); }

template <typename scalar_t>
float inverse_rms(const scalar_t* x, int64_t n, float eps) {
  vfloat squares{};
  for (int64_t i = 0; i < n; i += kLanes) {
    const vfloat v = widen(x + i);
    squares += v * v;
  }
  return 1.f / std::sqrt(sum_lanes(squares) / n + eps);
}

// weight * dtype(x * inv_rms): the normalised row is rounded to the model dtype before the weight.
template <typename scalar_t>
void normalise_row(scalar_t* out, const scalar_t* x, const scalar_t* weight, float eps, int64_t n) {
  const float inv = inverse_rms(x, n, eps);
  for (int64_t i = 0; i < n; i += kLanes) narrow(round_as<scalar_t>(widen(x + i) * inv) * widen(weight + i), out + i);
}

template <typename scalar_t>
void rms_norm_rows(scalar_t* out, scalar_t* residual, const scalar_t* x, const scalar_t* weight, float eps,
                   int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* source = x + r * n;
      if (residual != nullptr) {   // residual += x, rounded as the model dtype's add rounds
        scalar_t* stream = residual + r * n;
        for (int64_t i = 0; i < n; i += kLanes) narrow(widen(stream + i) + widen(source + i), stream + i);
        source = stream;
      }
      normalise_row(out + r * n, source, weight, eps, n);
    }
  });
}

void check_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && weight.is_contiguous(), "rms_norm: tensors must be contiguous");
  TORCH_CHECK(x.size(-1) % kLanes == 0 && weight.numel() == x.size(-1), "rms_norm: hidden size must be a multiple of 16");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "rms_norm: one dtype");
}

// One row of head_dim elements into a cache of cache_t, dst_stride apart (keys are stored
// transposed). The float types round to nearest even, as torch's .to() does. int8 rows are
// quantized symmetrically: scale = absmax / 127, element = round(x / scale) (ties to even), and
// the scale is returned (1 for the float types); an all-zero row stores zeros with scale 0.
template <typename cache_t, typename scalar_t>
float store_row(const scalar_t* src, int64_t n, cache_t* dst, int64_t dst_stride) {
  if constexpr (kScaled<cache_t>) {
    float absmax = 0.f;
    for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::abs(static_cast<float>(src[i])));
    const float scale = absmax / 127.f;
    const float divisor = scale > 0.f ? scale : 1.f;
    for (int64_t i = 0; i < n; ++i)
      dst[i * dst_stride] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(src[i]) / divisor),
                                                           -127.f, 127.f));
    return scale;
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i * dst_stride] = static_cast<cache_t>(src[i]);
    return 1.f;
  }
}

// kv heads [kv_first, kv_end) of every token; split(first, last, f): over the cores, or on the calling thread alone.
template <typename scalar_t, typename cache_t, typename Split>
void write_rows(const at::Tensor& k_cache, const at::Tensor& v_cache, const OptionalTensor& k_scales,
                const OptionalTensor& v_scales, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping,
                int64_t kv_first, int64_t kv_end, Split&& split) {
  const CacheLayout layout = paged_cache<cache_t>(k_cache, v_cache, k_scales, v_scales);
  const int64_t tokens = k.size(0), head_dim = layout.head_dim, block_size = layout.block_size;
  cache_t* keys = static_cast<cache_t*>(k_cache.data_ptr());
  cache_t* values = static_cast<cache_t*>(v_cache.data_ptr());
  float* key_scales = k_scales ? k_scales->data_ptr<float>() : nullptr;
  float* value_scales = v_scales ? v_scales->data_ptr<float>() : nullptr;
  const scalar_t* k_src = k.data_ptr<scalar_t>();
  const scalar_t* v_src = v.data_ptr<scalar_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  split(tokens, grain(2 * layout.num_kv_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = kv_first; h < kv_end; ++h) {
        const int64_t part = layout.part(block, h);   // this head's part of the block
        const float k_scale = store_row(k_src + t * k.stride(0) + h * k.stride(1), head_dim,
                                        keys + part + offset, block_size);   // transposed
        const float v_scale = store_row(v_src + t * v.stride(0) + h * v.stride(1), head_dim,
                                        values + part + offset * head_dim, 1);
        if constexpr (kScaled<cache_t>) {
          key_scales[layout.scale_part(block, h) + offset] = k_scale;
          value_scales[layout.scale_part(block, h) + offset] = v_scale;
        }
      }
    }
  });
}

}  // namespace

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  RECORD_FUNCTION("pagedllm::rms_norm", std::vector<c10::IValue>({out}));   // torch.profiler names it
  check_norm(out, x, weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), nullptr, x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            static_cast<float>(eps), x.numel() / x.size(-1), x.size(-1));
  });
}

void add_rms_norm(at::Tensor out, at::Tensor residual, at::Tensor x, at::Tensor weight, double eps) {
  RECORD_FUNCTION("pagedllm::add_rms_norm", std::vector<c10::IValue>({out}));   // torch.profiler names it
  check_norm(out, x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), static_cast<float>(eps), x.numel() / x.size(-1), x.size(-1));
  });
}

void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos_sin) {
  RECORD_FUNCTION("pagedllm::rotary_embedding", std::vector<c10::IValue>({x}));   // torch.profiler names it
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  TORCH_CHECK(x.stride(2) == 1 && half % kLanes == 0, "rotary_embedding: head_dim must be a multiple of 32, rows dense");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary_embedding: int64 positions");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.size(1) == head_dim,
              "rotary_embedding: cos_sin must be float32 [positions, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = table + pos[t] * head_dim;
        const float* sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* row = base + t * x.stride(0) + h * x.stride(1);
          for (int64_t i = 0; i < half; i += kLanes) {   // [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
            const vfloat x1 = widen(row + i), x2 = widen(row + half + i);
            const vfloat c = widen(cos + i), s = widen(sin + i);
            narrow(x1 * c - x2 * s, row + i);
            narrow(x2 * c + x1 * s, row + half + i);
          }
        }
      }
    });
  });
}

void silu_and_mul(at::Tensor out, at::Tensor gate_up) {
  RECORD_FUNCTION("pagedllm::silu_and_mul", std::vector<c10::IValue>({out}));   // torch.profiler names it
  const int64_t size = out.size(-1), rows = out.numel() / size;
  TORCH_CHECK(out.is_contiguous() && gate_up.is_contiguous() && gate_up.size(-1) == 2 * size && size % kLanes == 0,
              "silu_and_mul: contiguous [rows, 2 * size] -> [rows, size], size a multiple of 16");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* result = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * size;
        const scalar_t* up = gate + size;
        for (int64_t i = 0; i < size; i += kLanes) {
          const vfloat g = widen(gate + i);
          const vfloat e = exp_nonpositive(g < 0 ? g : -g);   // e^-|g|: no overflow either side
          const vfloat inverse = 1.f / (1.f + e);
          const vfloat sigmoid = g < 0 ? e * inverse : inverse;
          // silu rounded to the model dtype before the product, as F.silu(gate) * up
          narrow(round_as<scalar_t>(g * sigmoid) * widen(up + i), result + r * size + i);
        }
      }
    });
  });
}

namespace {

// write_kv's checks, then write_rows for kv heads [kv_first, kv_end), split by `split`.
template <typename Split>
void checked_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const OptionalTensor& k_scales,
                   const OptionalTensor& v_scales, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slot_mapping, int64_t kv_first, int64_t kv_end, const char* op, Split&& split) {
  check_caches(k_cache, v_cache, k_scales, v_scales, op);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.scalar_type() == v.scalar_type(), op,
              ": K and V rows dense, of one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), op, ": int64 slots");
  TORCH_CHECK(0 <= kv_first && kv_first <= kv_end && kv_end <= k_cache.size(1), op, ": kv heads must be a range "
              "within 0..", k_cache.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    dispatch_cache_type<scalar_t>(k_cache.scalar_type(), op, [&](auto element) {
      using cache_t = decltype(element);
      write_rows<scalar_t, cache_t>(k_cache, v_cache, k_scales, v_scales, k, v, slot_mapping, kv_first, kv_end, split);
    });
  });
}

}  // namespace

void write_kv(at::Tensor k_cache, at::Tensor v_cache, OptionalTensor k_scales, OptionalTensor v_scales, at::Tensor k,
              at::Tensor v, at::Tensor slot_mapping) {
  RECORD_FUNCTION("pagedllm::write_kv", std::vector<c10::IValue>({k_cache}));   // torch.profiler names it
  checked_write(k_cache, v_cache, k_scales, v_scales, k, v, slot_mapping, 0, k_cache.size(1), "write_kv",
                [](int64_t tokens, int64_t grain, const auto& f) { at::parallel_for(0, tokens, grain, f); });
}

void write_kv_heads(const at::Tensor& k_cache, const at::Tensor& v_cache, const OptionalTensor& k_scales,
                    const OptionalTensor& v_scales, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping, int64_t kv_first, int64_t kv_end) {
  checked_write(k_cache, v_cache, k_scales, v_scales, k, v, slot_mapping, kv_first, kv_end, "write_kv_heads",
                [](int64_t tokens, int64_t, const auto& f) { f(0, tokens); });
}
