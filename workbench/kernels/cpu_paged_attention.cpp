// Paged decode attention on the CPU: one query token per sequence, K/V read straight from the cache's blocks.
//
// The PyTorch reference (workbench/attention/torch_ref.py) gathers every sequence's blocks into a padded tensor and
// calls SDPA; for one query token per sequence that costs a copy of the whole context and a kernel built for long
// queries. This loop reads each K/V row where it lies (vLLM's CPU paged_attention_v1 does the same), in float32.
//
// Shapes (as paged_decode_attention_ref in reference.py):
//   q            [num_seqs, num_heads, head_dim]                      float32 or bfloat16, contiguous
//   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]     same dtype, contiguous
//   block_tables [num_seqs, max_blocks]                               int64
//   context_lens [num_seqs]                                           int64, the query's own token included, >= 1
//   returns      [num_seqs, num_heads, head_dim]                      q's dtype
// The query heads h*g .. h*g+g-1 share KV head h (grouped-query attention, g = num_heads / num_kv_heads).
// Softmax is two-pass per sequence: every head's scores, then max, exp, sum, then the weighted V.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = uint32_t(x.x) << 16;  // bfloat16 is the top half of a float32
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
}

// Softmax of each of ``rows`` rows of ``n`` scores, in place (max-subtracted, float32).
inline void softmax_rows(float* scores, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sh = scores + r * n;
    const float m = *std::max_element(sh, sh + n);
    float z = 0.f;
#pragma omp simd reduction(+ : z)
    for (int64_t t = 0; t < n; ++t) {
      sh[t] = std::exp(sh[t] - m);
      z += sh[t];
    }
    const float inv = 1.f / z;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sh[t] *= inv;
  }
}

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables, const int64_t* context_lens,
            T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
            int64_t max_blocks, float scale) {
  const int64_t g = num_heads / num_kv_heads, d = head_dim;
  const int64_t row = num_kv_heads * d;  // one token's K (or V) for every KV head: contiguous in a block
  // One job per sequence: a block's rows are read front to back (block_size x row elements, contiguous), which the
  // hardware prefetcher streams; a job per (sequence, KV head) would read a third of each row at a stride instead.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * d), acc(num_heads * d), rowf(row), scores;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t ctx = context_lens[s];
      const int64_t* table = block_tables + s * max_blocks;
      row_to_float(q + s * num_heads * d, qf.data(), num_heads * d);
      for (int64_t i = 0; i < num_heads * d; ++i) qf[i] *= scale;
      scores.resize(num_heads * ctx);  // [num_heads][ctx]
      for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += block_size, ++b) {
        const T* kb = k_cache + table[b] * block_size * row;
        const int64_t nt = std::min(block_size, ctx - t0);
        for (int64_t o = 0; o < nt; ++o) {
          row_to_float(kb + o * row, rowf.data(), row);
          for (int64_t hq = 0; hq < num_heads; ++hq) {  // query head hq reads KV head hq / g
            const float* qh = qf.data() + hq * d;
            const float* kh = rowf.data() + (hq / g) * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; ++i) dot += qh[i] * kh[i];
            scores[hq * ctx + t0 + o] = dot;
          }
        }
      }
      softmax_rows(scores.data(), num_heads, ctx);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += block_size, ++b) {
        const T* vb = v_cache + table[b] * block_size * row;
        const int64_t nt = std::min(block_size, ctx - t0);
        for (int64_t o = 0; o < nt; ++o) {
          row_to_float(vb + o * row, rowf.data(), row);
          for (int64_t hq = 0; hq < num_heads; ++hq) {
            const float p = scores[hq * ctx + t0 + o];
            const float* vh = rowf.data() + (hq / g) * d;
            float* ah = acc.data() + hq * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ah[i] += p * vh[i];
          }
        }
      }
      T* o = out + s * num_heads * d;
      for (int64_t i = 0; i < num_heads * d; ++i) o[i] = T(acc[i]);
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The same computation for bfloat16 with AVX512-BF16's dot-product instruction (vdpbf16ps: 32 bfloat16 products
// summed in pairs into 16 float32 lanes), compiled where -march=native finds it (this CPU has it, or the build
// differs: the extension's name hashes the CPU's flags). q·k takes head_dim / 32 instructions and one horizontal
// sum instead of converting every K row to float32 first; the exact bfloat16 x bfloat16 products are scaled after
// the sum. V is widened to float32 16 lanes at a time (a shift) and accumulated with FMAs, as before.
constexpr bool kHaveBf16Dot = true;

inline __m512 bf16x16_to_float(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

void decode_bf16_dot(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                     const int64_t* block_tables, const int64_t* context_lens, c10::BFloat16* out, int64_t num_seqs,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                     float scale) {
  const int64_t g = num_heads / num_kv_heads, d = head_dim, nv = d / 32, nf = d / 16;
  const int64_t row = num_kv_heads * d;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> qv(num_heads * nv);
    std::vector<float> acc(num_heads * d), scores;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t ctx = context_lens[s];
      const int64_t* table = block_tables + s * max_blocks;
      const c10::BFloat16* qs = q + s * num_heads * d;
      for (int64_t i = 0; i < num_heads * nv; ++i) qv[i] = _mm512_loadu_si512(qs + i * 32);
      scores.resize(num_heads * ctx);
      for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += block_size, ++b) {
        const c10::BFloat16* kb = k_cache + table[b] * block_size * row;
        const int64_t nt = std::min(block_size, ctx - t0);
        for (int64_t o = 0; o < nt; ++o) {
          const c10::BFloat16* kr = kb + o * row;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            for (int64_t hq = h * g; hq < (h + 1) * g; ++hq) {
              __m512 a = _mm512_setzero_ps();
              for (int64_t j = 0; j < nv; ++j) {
                __m512i kj = _mm512_loadu_si512(kr + h * d + j * 32);
                a = _mm512_dpbf16_ps(a, (__m512bh)qv[hq * nv + j], (__m512bh)kj);
              }
              scores[hq * ctx + t0 + o] = _mm512_reduce_add_ps(a) * scale;
            }
          }
        }
      }
      softmax_rows(scores.data(), num_heads, ctx);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += block_size, ++b) {
        const c10::BFloat16* vb = v_cache + table[b] * block_size * row;
        const int64_t nt = std::min(block_size, ctx - t0);
        for (int64_t o = 0; o < nt; ++o) {
          const c10::BFloat16* vr = vb + o * row;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            for (int64_t j = 0; j < nf; ++j) {
              const __m512 v = bf16x16_to_float(vr + h * d + j * 16);
              for (int64_t hq = h * g; hq < (h + 1) * g; ++hq) {
                float* ah = acc.data() + hq * d + j * 16;
                _mm512_storeu_ps(ah, _mm512_fmadd_ps(_mm512_set1_ps(scores[hq * ctx + t0 + o]), v, _mm512_loadu_ps(ah)));
              }
            }
          }
        }
      }
      c10::BFloat16* os = out + s * num_heads * d;
      for (int64_t i = 0; i < num_heads * d; ++i) os[i] = c10::BFloat16(acc[i]);
    }
  });
}
#else
constexpr bool kHaveBf16Dot = false;
#endif

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [num_seqs, num_heads, head_dim] and the caches [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "dtype must be float32 or bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
                  context_lens.is_contiguous(), "every tensor must be contiguous");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head_dim or head counts do not match");
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs, "one block table and length per sequence");
  auto out = torch::empty_like(q);
  const int64_t max_blocks = block_tables.size(1);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (q.scalar_type() == at::kBFloat16 && head_dim % 32 == 0) {
    using B = c10::BFloat16;
    decode_bf16_dot(static_cast<const B*>(q.data_ptr()), static_cast<const B*>(k_cache.data_ptr()),
                    static_cast<const B*>(v_cache.data_ptr()), block_tables.data_ptr<int64_t>(),
                    context_lens.data_ptr<int64_t>(), static_cast<B*>(out.data_ptr()), num_seqs, num_heads,
                    num_kv_heads, head_dim, block_size, max_blocks, static_cast<float>(scale));
    return out;
  }
#endif
  if (q.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    decode<B>(static_cast<const B*>(q.data_ptr()), static_cast<const B*>(k_cache.data_ptr()),
              static_cast<const B*>(v_cache.data_ptr()), block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
              static_cast<B*>(out.data_ptr()), num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks,
              static_cast<float>(scale));
  } else {
    decode<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_seqs,
                  num_heads, num_kv_heads, head_dim, block_size, max_blocks, static_cast<float>(scale));
  }
  return out;
}

}  // namespace

void register_layer_ops(pybind11::module& m);  // cpu_layer_ops.cpp, built into the same extension

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_layer_ops(m);
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention on the CPU (see the file's head)");
  m.attr("bf16_dot_product") = kHaveBf16Dot;
}
