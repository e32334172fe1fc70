// The element-wise glue of a Llama layer on the CPU in bfloat16, one pass each instead of several torch ops.
//
// Between a layer's matmuls the eager model (workbench/model/llama.py) runs RMSNorm as four ops (widen to float32,
// normalise, round, scale), RoPE as five (two products, a split, a negation, a concatenation, a sum) and SwiGLU's
// SiLU(gate) * up as two, each a pass over memory plus a dispatch. These loops do each in one pass and round where
// the eager ops round, so that the results equal the eager ones except where a float32 sum or exp is taken in
// another order and tips a rounding (one bfloat16 step; two where a product follows, as in SiLU(gate) * up). bfloat16 only; workbench/kernels/cpu_layer_ops.py wraps them.
//
//   rms_norm(x [T, H], weight [H], eps) -> bf16(weight * bf16(x * rsqrt(mean(x^2) + eps)))
//       (Zhang & Sennrich, 2019; transformers' LlamaRMSNorm, which normalises in float32)
//   silu_and_mul(gate_up [T, 2I]) -> [T, I] = bf16(bf16(silu(gate)) * up)  (Shazeer, 2020)
//   rotary(x [T, heads, D], each token's heads contiguous, rows at any stride; cos, sin [T, D]) -> [T, heads, D]
//       = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = (-x2, x1)   (Su et al., 2021, eq. 34)

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>

namespace {

using B = c10::BFloat16;

inline float f32(B x) {
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline B bf16(float f) { return B(f); }  // round to nearest even, as torch's casts

// Rows per task: enough work per thread to pay for the hand-off at a decode batch's few rows.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t h = weight.numel(), t = x.numel() / h;
  TORCH_CHECK(x.size(-1) == h, "x's last dimension must be weight's size");
  auto y = torch::empty_like(x);
  const B* xp = static_cast<const B*>(x.data_ptr());
  const B* wp = static_cast<const B*>(weight.data_ptr());
  B* yp = static_cast<B*>(y.data_ptr());
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, t, grain(h), [&](int64_t begin, int64_t end) {
    std::vector<float> r(h);
    for (int64_t i = begin; i < end; ++i) {
      const B* xi = xp + i * h;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) r[j] = f32(xi[j]);
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < h; ++j) ss += r[j] * r[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + feps);
      B* yi = yp + i * h;
      for (int64_t j = 0; j < h; ++j) yi[j] = bf16(f32(wp[j]) * f32(bf16(r[j] * inv)));
    }
  });
  return y;
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1), n = two_i / 2, t = gate_up.numel() / two_i;
  TORCH_CHECK(two_i % 2 == 0, "gate_up's last dimension must be even (gate, then up)");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gate_up.options());
  const B* gp = static_cast<const B*>(gate_up.data_ptr());
  B* op = static_cast<B*>(out.data_ptr());
  at::parallel_for(0, t, grain(two_i), [&](int64_t begin, int64_t end) {
    std::vector<float> s(n);
    for (int64_t i = begin; i < end; ++i) {
      const B* g = gp + i * two_i;
      const B* u = g + n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float x = f32(g[j]);
        s[j] = x / (1.f + std::exp(-x));
      }
      B* o = op + i * n;
      for (int64_t j = 0; j < n; ++j) o[j] = bf16(f32(bf16(s[j])) * f32(u[j]));
    }
  });
  return out;
}

torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be a bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 3, "x must be [num_tokens, heads, head_dim]");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2, stride = x.stride(0);
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == d, "each token's heads must be contiguous in x");
  TORCH_CHECK(d % 2 == 0 && cos.numel() == t * d && sin.numel() == t * d, "cos and sin must be [num_tokens, head_dim]");
  auto out = torch::empty({t, heads, d}, x.options());
  const B* xp = static_cast<const B*>(x.data_ptr());
  const B* cp = static_cast<const B*>(cos.data_ptr());
  const B* sp = static_cast<const B*>(sin.data_ptr());
  B* op = static_cast<B*>(out.data_ptr());
  at::parallel_for(0, t, grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const B* c = cp + i * d;
      const B* s = sp + i * d;
      for (int64_t h = 0; h < heads; ++h) {
        const B* xi = xp + i * stride + h * d;
        B* o = op + (i * heads + h) * d;
        for (int64_t j = 0; j < half; ++j) {  // first half: x1 * cos - x2 * sin
          const float a = f32(bf16(f32(xi[j]) * f32(c[j])));
          const float b = f32(bf16(-f32(xi[j + half]) * f32(s[j])));
          o[j] = bf16(a + b);
        }
        for (int64_t j = half; j < d; ++j) {  // second half: x2 * cos + x1 * sin
          const float a = f32(bf16(f32(xi[j]) * f32(c[j])));
          const float b = f32(bf16(f32(xi[j - half]) * f32(s[j])));
          o[j] = bf16(a + b);
        }
      }
    }
  });
  return out;
}

}  // namespace

void register_layer_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm in bfloat16, normalised in float32 (see the file's head)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of a fused gate/up projection, bfloat16");
  m.def("rotary", &rotary, "RoPE in the rotate-half layout, bfloat16");
}
