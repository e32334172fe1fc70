// Paged decode attention on the CPU: one query token per sequence, K/V read straight from the cache's blocks.
//
// The PyTorch reference (workbench/attention/torch_ref.py) gathers every sequence's blocks into a padded tensor and
// calls SDPA; for one query token per sequence that costs a copy of the whole context and a kernel built for long
// queries. These loops read each K/V row where it lies (vLLM's CPU paged_attention_v1 does the same), in float32.
// Three versions, by dtype and head_dim: decode (float32 or bfloat16, any head_dim: one row at a time, converted to
// float32), decode_bf16_dot (bfloat16, head_dim a multiple of 32, AVX512-BF16: one dot product per position and
// head, "rowwise") and decode_rows (bfloat16, head_dim 64 or 128, AVX512-BF16: 16 positions per step, see below).
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
#include <atomic>
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

// ---------------------------------------------------------------------------------------------------------------
// Query chunks of any length over a paged context (prefill, chunked prefill over cached context, decode), bfloat16.
//
// Sequence s has query rows query_start[s] .. query_start[s+1]-1, which are the last qlen of its context_lens[s]
// tokens (their K/V already in the cache); row r attends causally to positions 0 .. ctx - qlen + r. This replaces
// the reference's gather of the whole context and SDPA with an explicit mask (paged_prefill_attention_ref): K/V
// rows are read where they lie, 32 positions at a time (two tiles of 16), with an online softmax (Dao et al.,
// FlashAttention, 2022, Algorithm 1; Milakov & Gimelshein, 2018) kept in float32 per (row, head) and updated once per
// 32 positions.
//   - q·k: 16 positions' K rows transposed once per KV head (transpose16: kt[i] lane j = dims 2i, 2i+1 of
//     position j), then vdpbf16ps of each query's broadcast pair of dims against kt[i] gives all 16 scores at once,
//     8 rows side by side (no horizontal sums; the tile's rows and the group's heads share the transpose);
//   - p·V: p rounded to bfloat16 (as SDPA's bfloat16 CPU kernel does) and vdpbf16ps on V's rows interleaved in
//     pairs of positions, built once per 32 positions and KV head and shared by the group's heads and the tile's rows.
// Work is split into (sequence, tile of up to kTileRows query rows) jobs, longest first, handed out dynamically:
// one long prompt and many decodes share a step.
constexpr int64_t kTileRows = 8;
// How far ahead to prefetch, in positions: the distance that was best of those tried (see docs/benchmarks.md,
// section "The C++ decode kernel").
constexpr int64_t kAhead = 32;
// How much of the next sequence's K and V the decode kernel prefetches to L2 while it computes the current one:
// 384 KiB, 512 positions of SmolLM2-135M, 37.5% of a 1 MiB L2 (see docs/benchmarks.md, section
// "The C++ decode kernel").
constexpr int64_t kNextBytes = 384 * 1024;
constexpr float kMasked = -1e30f;  // finite: -ffast-math assumes no infinities

// e^x for 16 lanes, x <= 0 (scores minus their max): Cephes' expf polynomial after a range reduction by ln 2.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Lane j of the result is the sum of the 16 lanes of v[kSlot[j]]: a shuffle tree (pairs of 256-bit halves, then
// 128-bit quarters, then within 128-bit lanes) leaves the sums in the lane order of a 4 x 4 transpose, so callers
// store position j's partial sums at v[kSlot[j]].
constexpr int kSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44), _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// Transposes 16 rows of 16 32-bit words: out[c] lane r = in[r] lane c. Within 128-bit lanes first (unpack 32, 64),
// then the 4 x 4 grid of 128-bit lanes across vectors (shuffle_i32x4 twice).
inline void transpose16(const __m512i* in, __m512i* out) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(in[2 * k], in[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(in[2 * k], in[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k+m], 128-bit lane L: column 4L+m of rows 4k .. 4k+3
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i a0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), a1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i b0 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44), b1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    out[m] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    out[4 + m] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
    out[8 + m] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    out[12 + m] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
  }
}

// The cache rows of positions t0 .. t0+15, walking the block table (no division per position); positions at or past
// ``limit`` repeat the row of position limit-1, which callers mask. Returns how many are below limit (at most 16).
inline int64_t rows_of(const int64_t* table, int64_t t0, int64_t limit, int64_t block_size, const c10::BFloat16* cache,
                       int64_t row, const c10::BFloat16** p) {
  const int64_t n = std::min<int64_t>(16, limit - t0);
  int64_t b = t0 / block_size, o = t0 % block_size;
  const c10::BFloat16* base = cache + table[b] * block_size * row;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = base + o * row;
    if (++o == block_size && t0 + j + 1 < limit) {
      o = 0;
      base = cache + table[++b] * block_size * row;
    }
  }
  for (int64_t j = n; j < 16; ++j) p[j] = p[n - 1];
  return n;
}

// Calls f(k_line, v_line) for every 64-byte cache line of the K and V rows of positions t0 .. t0+15 below limit, in
// position order.
template <typename F>
inline void for_each_line(const int64_t* table, int64_t t0, int64_t limit, int64_t block_size,
                          const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, int64_t row, F&& f) {
  if (t0 >= limit) return;
  const c10::BFloat16* rows[16];
  const int64_t n = rows_of(table, t0, limit, block_size, k_cache, row, rows);
  for (int64_t j = 0; j < n; ++j) {
    const char* kn = reinterpret_cast<const char*>(rows[j]);
    const char* vn = reinterpret_cast<const char*>(v_cache + (rows[j] - k_cache));
    for (int64_t b = 0; b < row * 2; b += 64) f(kn + b, vn + b);
  }
}

// Prefetches the K and V rows of positions t0 .. t0+15 below limit to L1.
inline void prefetch_rows(const int64_t* table, int64_t t0, int64_t limit, int64_t block_size,
                          const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, int64_t row) {
  for_each_line(table, t0, limit, block_size, k_cache, v_cache, row, [](const char* k, const char* v) {
    _mm_prefetch(k, _MM_HINT_T0);
    _mm_prefetch(v, _MM_HINT_T0);
  });
}

// The same lines listed instead of prefetched, K's and V's alternating (even index: K, odd: V), so that a tile's
// prefetches can be spread over its work instead of issued in one burst. ``out`` holds lines_per_tile(row)
// pointers. Returns how many it wrote.
inline int64_t lines_per_tile(int64_t row) { return 2 * 16 * ((row * 2 + 63) / 64); }

inline int64_t lines_of(const int64_t* table, int64_t t0, int64_t limit, int64_t block_size,
                        const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, int64_t row, const char** out) {
  int64_t m = 0;
  for_each_line(table, t0, limit, block_size, k_cache, v_cache, row, [&](const char* k, const char* v) {
    out[m++] = k;
    out[m++] = v;
  });
  return m;
}

// V's rows in pairs of positions, interleaved (v[2i][d], v[2i+1][d]) so that one vdpbf16ps adds two positions' p·v to
// 16 dims; within a 128-bit lane unpack takes dims 8k..8k+3 (lo) and 8k+4..8k+7 (hi). KV head h, pairs 0..npairs-1.
template <int D>
inline void interleave_v_pairs(const c10::BFloat16* const* vp, int64_t h, int64_t npairs, __m512i* vv) {
  constexpr int NQ = D / 32, NF = D / 16;
  for (int64_t jp = 0; jp < npairs; ++jp)
    for (int c = 0; c < NQ; ++c) {
      const __m512i a = _mm512_loadu_si512(vp[2 * jp] + h * D + c * 32);
      const __m512i b = _mm512_loadu_si512(vp[2 * jp + 1] + h * D + c * 32);
      vv[jp * NF + 2 * c] = _mm512_unpacklo_epi16(a, b);
      vv[jp * NF + 2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
}

// One head's output from accumulators built on interleave_v_pairs' vectors, times inv (1 / the softmax's sum):
// accumulator lane i holds dim c*32 + 8k + 4*half + m (see the unpack).
template <int D>
inline void store_head(const float* acc, float inv, c10::BFloat16* out) {
  for (int64_t i = 0; i < D; ++i) {
    const int64_t x = i / 16, lane = i % 16, k = lane / 4, m = lane % 4;
    out[(x / 2) * 32 + 8 * k + 4 * (x % 2) + m] = c10::BFloat16(acc[i] * inv);
  }
}

struct ChunkJob {
  int64_t seq, row0, rows, cost;
};

// q·k of kTileRows rows (query head at pair offset off) against NH transposed 16-position tiles of K: sr[u * 8 + r].
template <int D, int NH>
inline void qk_tiles(const uint32_t* const* qw, int64_t off, const __m512i* kt /* NH x D/2 */, __m512* sr) {
  for (int x = 0; x < NH * kTileRows; ++x) sr[x] = _mm512_setzero_ps();
  for (int i = 0; i < D / 2; ++i)
    for (int r = 0; r < kTileRows; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qw[r][off + i]);
      for (int u = 0; u < NH; ++u)
        sr[u * kTileRows + r] = _mm512_dpbf16_ps(sr[u * kTileRows + r], qb, (__m512bh)kt[u * (D / 2) + i]);
    }
}

// One job: rows row0 .. row0+rows-1 of sequence seq, every head. D = head_dim (a multiple of 32). The context goes
// by in steps of 32 positions, two tiles of 16 (the second left out where no row sees it): one online-softmax update
// per row per 32 positions, so its horizontal max and sum, exp of the correction and the accumulators' load, rescale
// and store are paid once per 32 positions instead of once per 16.
template <int D>
void attend_rows(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                 const int64_t* table, int64_t qbase, int64_t qlen, int64_t ctx, const ChunkJob& job,
                 c10::BFloat16* out, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
                 float* state /* rows * num_heads * (D + 2) floats */, __m512i* vv /* 16 * D / 16 vectors */) {
  using B = c10::BFloat16;
  constexpr int NQ = D / 32, NF = D / 16;
  const int64_t g = num_heads / num_kv_heads, row = num_kv_heads * D;
  const int64_t first_pos = ctx - qlen + job.row0;  // position of the job's first query row
  const int64_t last_pos = first_pos + job.rows - 1;
  const int64_t stride = D + 2;  // per (row, head): acc[D], running max, running sum
  for (int64_t i = 0; i < job.rows * num_heads; ++i) {
    float* st = state + i * stride;
    std::fill(st, st + D, 0.f);
    st[D] = kMasked;
    st[D + 1] = 0.f;
  }
  const B* kp[32];
  const B* vp[32];
  alignas(64) uint32_t pj[16];
  const uint32_t* qw[kTileRows];  // each row's q as pairs of dims; rows past the job repeat its last (ignored)
  for (int64_t r = 0; r < kTileRows; ++r)
    qw[r] = reinterpret_cast<const uint32_t*>(q + (qbase + job.row0 + std::min(r, job.rows - 1)) * num_heads * D);
  for (int64_t t0 = 0; t0 <= last_pos; t0 += 32) {
    const int nh = t0 + 16 <= last_pos ? 2 : 1;  // tiles of 16 that some row sees
    int64_t nt[2] = {0, 0};
    for (int u = 0; u < nh; ++u) {
      nt[u] = rows_of(table, t0 + 16 * u, ctx, block_size, k_cache, row, kp + 16 * u);  // past the context: masked
      for (int j = 0; j < 16; ++j) vp[16 * u + j] = v_cache + (kp[16 * u + j] - k_cache);
    }
    // Ask now for the K/V rows of the positions kAhead further on: blocks lie anywhere in the pool, so the hardware
    // prefetcher cannot guess the next one, and a long context streams from memory.
    prefetch_rows(table, t0 + kAhead, last_pos + 1, block_size, k_cache, v_cache, row);
    prefetch_rows(table, t0 + kAhead + 16, last_pos + 1, block_size, k_cache, v_cache, row);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      interleave_v_pairs<D>(vp, h, 8 * nh, vv);
      // K transposed once per 16 positions and KV head: kt[i] lane j holds dims (2i, 2i+1) of position j, so one
      // vdpbf16ps with a query's broadcast pair of dims adds to all 16 positions' scores at once, for 8 rows.
      __m512i kt[2 * (D / 2)];
      for (int u = 0; u < nh; ++u)
        for (int c = 0; c < NQ; ++c) {
          __m512i in[16];
          for (int j = 0; j < 16; ++j) in[j] = _mm512_loadu_si512(kp[16 * u + j] + h * D + c * 32);
          transpose16(in, kt + u * (D / 2) + c * 16);
        }
      for (int64_t hq = h * g; hq < (h + 1) * g; ++hq) {
        __m512 sr[2 * kTileRows];
        if (nh == 2)
          qk_tiles<D, 2>(qw, hq * D / 2, kt, sr);
        else
          qk_tiles<D, 1>(qw, hq * D / 2, kt, sr);
        for (int64_t r = 0; r < job.rows; ++r) {
          const int64_t pos = first_pos + r;
          if (t0 > pos) continue;  // this row sees none of these positions
          __m512 s[2], p[2];
          __mmask16 valid[2];
          int64_t seen = 0;  // positions of the 32 this row sees (the rest of a tile is masked)
          for (int u = 0; u < 2; ++u) {
            const int64_t tu = t0 + 16 * u;
            const int64_t nv = u < nh && tu <= pos ? std::min<int64_t>(nt[u], pos - tu + 1) : 0;
            seen = nv > 0 ? 16 * u + nv : seen;
            valid[u] = static_cast<__mmask16>((1u << nv) - 1u);
            s[u] = nv > 0 ? _mm512_mask_mul_ps(_mm512_set1_ps(kMasked), valid[u], sr[u * kTileRows + r],
                                               _mm512_set1_ps(scale))
                          : _mm512_set1_ps(kMasked);
          }
          float* st = state + (r * num_heads + hq) * stride;
          const float m_old = st[D];
          const float m_new = std::max(m_old, _mm512_reduce_max_ps(_mm512_max_ps(s[0], s[1])));
          const float corr = std::exp(m_old - m_new);
          for (int u = 0; u < 2; ++u) p[u] = _mm512_maskz_mov_ps(valid[u], exp16(_mm512_sub_ps(s[u], _mm512_set1_ps(m_new))));
          st[D] = m_new;
          st[D + 1] = st[D + 1] * corr + _mm512_reduce_add_ps(_mm512_add_ps(p[0], p[1]));
          for (int u = 0; u < 2; ++u)  // p in bfloat16
            _mm256_store_si256(reinterpret_cast<__m256i*>(pj + 8 * u), (__m256i)_mm512_cvtneps_pbh(p[u]));
          __m512 acc[NF];
          for (int c = 0; c < NF; ++c) acc[c] = _mm512_mul_ps(_mm512_loadu_ps(st + c * 16), _mm512_set1_ps(corr));
          for (int64_t jp = 0; jp < (seen + 1) / 2; ++jp) {
            const __m512i pp = _mm512_set1_epi32(pj[jp]);  // (p[2jp], p[2jp+1])
            for (int c = 0; c < NF; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)pp, (__m512bh)vv[jp * NF + c]);
          }
          for (int c = 0; c < NF; ++c) _mm512_storeu_ps(st + c * 16, acc[c]);
        }
      }
    }
  }
  for (int64_t r = 0; r < job.rows; ++r) {
    B* o = out + (qbase + job.row0 + r) * num_heads * D;
    for (int64_t hq = 0; hq < num_heads; ++hq) {
      const float* st = state + (r * num_heads + hq) * stride;
      store_head<D>(st, 1.f / st[D + 1], o + hq * D);
    }
  }
}

template <int D>
void attend_chunks(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                   const int64_t* block_tables, const int64_t* query_start, const int64_t* context_lens,
                   c10::BFloat16* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                   int64_t max_blocks, float scale) {
  std::vector<ChunkJob> jobs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = query_start[s + 1] - query_start[s], ctx = context_lens[s];
    for (int64_t r0 = 0; r0 < qlen; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, qlen - r0);
      jobs.push_back({s, r0, rows, rows * (ctx - qlen + r0 + rows)});
    }
  }
  std::stable_sort(jobs.begin(), jobs.end(), [](const ChunkJob& a, const ChunkJob& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), njobs), 1, [&](int64_t, int64_t) {
    std::vector<float> state(kTileRows * num_heads * (D + 2));
    __m512i vv[16 * D / 16];
    for (int64_t i = next++; i < njobs; i = next++) {
      const ChunkJob& job = jobs[i];
      const int64_t qbase = query_start[job.seq];
      attend_rows<D>(q, k_cache, v_cache, block_tables + job.seq * max_blocks, qbase,
                     query_start[job.seq + 1] - qbase, context_lens[job.seq], job, out, num_heads, num_kv_heads,
                     block_size, scale, state.data(), vv);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// The next sequence's prefetch: a thread claims its next sequence before it starts the current one, and while it
// computes the current one it prefetches the next one's K and V rows to L2, in position order, ``quota`` cache lines
// at a time between pieces of work. Without it the kernel's memory traffic and its arithmetic take turns out of
// cache (benchmarks/cpu_attention.py --layers 30; see docs/benchmarks.md, section
// "The C++ decode kernel"): spread this way they overlap.
// Only the first positions up to kNextBytes of K and V are fetched so, leaving room in L2 for the current sequence.
struct NextSequencePrefetch {
  const int64_t* table = nullptr;
  int64_t limit = 0;  // positions to prefetch
  int64_t t = 0;      // the next tile to list
  int64_t n = 0, i = 0;  // lines listed, lines issued
  std::vector<const char*> lines;

  void start(const int64_t* next_table, int64_t positions, int64_t row) {
    table = next_table;
    limit = positions;
    t = n = i = 0;
    lines.resize(lines_per_tile(row));
  }
  // Positions whose lines have all been issued.
  int64_t done() const { return i == n ? std::min(t, limit) : t - 16; }
  void issue(int64_t quota, int64_t block_size, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
             int64_t row) {
    for (; quota > 0; --quota) {
      if (i == n) {
        if (t >= limit) return;
        n = lines_of(table, t, limit, block_size, k_cache, v_cache, row, lines.data());
        t += 16;
        i = 0;
      }
      _mm_prefetch(lines[i++], _MM_HINT_T1);
    }
  }
};

// Decode rows, head_dim D (64 or 128): one query per sequence, in the chunk kernel's instructions but two passes
// instead of an online softmax, since one row's scores fit in a buffer (num_heads x ctx floats).
//   1. q·k for 16 positions at a time per query head (vdpbf16ps + sum16), the scores stored; unless the previous
//      sequence's work prefetched them (NextSequencePrefetch), the K rows 32 positions on are prefetched to L1 and
//      their V rows to L2 (pass 3 reads them again, a sequence's V fits in L2), a few lines per query head;
//   2. softmax per head in float32 (exp16), p stored rounded to bfloat16 as pairs of positions;
//   3. p·V with vdpbf16ps on V's rows interleaved in pairs, the accumulators shared over the context.
// Sequences are handed out longest first, one at a time (contexts differ by thousands of tokens in one batch); while
// enough are left for the other threads, each thread claims its next one a sequence early so that it can prefetch it
// (see NextSequencePrefetch).
template <int D>
void decode_seq(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                const int64_t* table, int64_t ctx, c10::BFloat16* out, int64_t num_heads, int64_t num_kv_heads,
                int64_t block_size, float scale, std::vector<float>& sc, std::vector<uint16_t>& pb, float* acc,
                float* inv /* num_heads */, __m512i* vv, std::vector<const char*>& near,
                NextSequencePrefetch& next_seq, int64_t prefetched) {
  using B = c10::BFloat16;
  constexpr int NQ = D / 32, NF = D / 16;
  const int64_t g = num_heads / num_kv_heads, row = num_kv_heads * D, cpad = (ctx + 15) / 16 * 16;
  sc.resize(num_heads * cpad);
  pb.resize(num_heads * cpad);
  // the next sequence's lines, spread evenly over this one's 2 x tiles x num_heads pieces of work (passes 1 and 3)
  const int64_t pieces = std::max<int64_t>(1, 2 * (cpad / 16) * num_heads);
  const int64_t quota = (next_seq.limit / 16 + 1) * lines_per_tile(row) / pieces + 1;
  near.resize(lines_per_tile(row));
  const B* kp[16];
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    const int64_t nt = rows_of(table, t0, ctx, block_size, k_cache, row, kp);
    // positions kAhead on that no one prefetched yet, K to L1 and V to L2, spread over the query heads (one burst of
    // a tile's lines per tile stalled the loads; 48 or 64 ahead were no better)
    const int64_t from = std::max(t0 + kAhead, prefetched);
    const int64_t nnear = from < t0 + kAhead + 16 ? lines_of(table, from, ctx, block_size, k_cache, v_cache, row,
                                                             near.data()) : 0;
    const int64_t per_head = (nnear + num_heads - 1) / num_heads;
    int64_t ip = 0;
    const __mmask16 valid = static_cast<__mmask16>((1u << nt) - 1u);
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t hq = h * g; hq < (h + 1) * g; ++hq) {
        for (const int64_t e = std::min(ip + per_head, nnear); ip < e; ip += 2) {
          _mm_prefetch(near[ip], _MM_HINT_T0);
          _mm_prefetch(near[ip + 1], _MM_HINT_T1);
        }
        next_seq.issue(quota, block_size, k_cache, v_cache, row);
        __m512i qv[NQ];
        for (int c = 0; c < NQ; ++c) qv[c] = _mm512_loadu_si512(q + hq * D + c * 32);
        __m512 dots[16];
        for (int j = 0; j < 16; ++j) {
          __m512 a = _mm512_setzero_ps();
          for (int c = 0; c < NQ; ++c)
            a = _mm512_dpbf16_ps(a, (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512(kp[j] + h * D + c * 32));
          dots[kSlot[j]] = a;
        }
        const __m512 s = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
        _mm512_storeu_ps(sc.data() + hq * cpad + t0, _mm512_mask_mov_ps(_mm512_set1_ps(kMasked), valid, s));
      }
  }
  const __mmask16 last = static_cast<__mmask16>((1u << (ctx - (cpad - 16))) - 1u);
  for (int64_t hq = 0; hq < num_heads; ++hq) {
    const float* sh = sc.data() + hq * cpad;
    __m512 m = _mm512_set1_ps(kMasked);
    for (int64_t t0 = 0; t0 < cpad; t0 += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sh + t0));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 z = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < cpad; t0 += 16) {
      const __m512 p = _mm512_maskz_mov_ps(t0 + 16 < cpad ? __mmask16(0xFFFF) : last,
                                           exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + t0), mx)));
      z = _mm512_add_ps(z, p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.data() + hq * cpad + t0), (__m256i)_mm512_cvtneps_pbh(p));
    }
    inv[hq] = 1.f / _mm512_reduce_add_ps(z);
  }
  std::fill(acc, acc + num_heads * D, 0.f);
  const B* vp[16];
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    const int64_t nt = rows_of(table, t0, ctx, block_size, v_cache, row, vp);
    const int64_t npairs = (nt + 1) / 2;  // a pair past the context has p = 0
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      interleave_v_pairs<D>(vp, h, npairs, vv);
      for (int64_t hq = h * g; hq < (h + 1) * g; ++hq) {
        next_seq.issue(quota, block_size, k_cache, v_cache, row);
        const uint32_t* pp = reinterpret_cast<const uint32_t*>(pb.data() + hq * cpad + t0);
        float* ah = acc + hq * D;
        __m512 a[NF];
        for (int c = 0; c < NF; ++c) a[c] = _mm512_loadu_ps(ah + c * 16);
        for (int64_t jp = 0; jp < npairs; ++jp) {
          const __m512i p2 = _mm512_set1_epi32(pp[jp]);
          for (int c = 0; c < NF; ++c) a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)p2, (__m512bh)vv[jp * NF + c]);
        }
        for (int c = 0; c < NF; ++c) _mm512_storeu_ps(ah + c * 16, a[c]);
      }
    }
  }
  for (int64_t hq = 0; hq < num_heads; ++hq) store_head<D>(acc + hq * D, inv[hq], out + hq * D);
}

template <int D>
void decode_rows(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                 const int64_t* block_tables, const int64_t* context_lens, c10::BFloat16* out, int64_t num_seqs,
                 int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale) {
  std::vector<int64_t> order(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return context_lens[a] > context_lens[b]; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_seqs);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> sc, acc(num_heads * D), inv(num_heads);
    std::vector<uint16_t> pb;
    std::vector<const char*> near;
    __m512i vv[8 * D / 16];
    NextSequencePrefetch next_seq;
    const int64_t row = num_kv_heads * D, cap = std::max<int64_t>(16, kNextBytes / (row * 2 * 2));
    int64_t prefetched = 0;  // positions of the current sequence that the previous one's work prefetched
    for (int64_t i = next++; i < num_seqs;) {
      // claim the next sequence now, to prefetch it, only while every other thread still has one left to take: a
      // sequence claimed early waits for this one, and an idle thread could have run it
      const int64_t j = next.load() + threads <= num_seqs ? next++ : num_seqs;
      const bool ahead = j < num_seqs;
      next_seq.start(ahead ? block_tables + order[j] * max_blocks : nullptr,
                     ahead ? std::min(context_lens[order[j]], cap) : 0, row);
      const int64_t s = order[i];
      decode_seq<D>(q + s * num_heads * D, k_cache, v_cache, block_tables + s * max_blocks, context_lens[s],
                    out + s * num_heads * D, num_heads, num_kv_heads, block_size, scale, sc, pb, acc.data(), inv.data(),
                    vv, near, next_seq, prefetched);
      prefetched = next_seq.done();
      i = ahead ? j : next++;
    }
  });
}
#else
constexpr bool kHaveBf16Dot = false;
#endif

// Checks both kernels share, each refusal naming what it found (before any read): every tensor on the CPU and
// contiguous, the index tensors int64, q [tokens, num_heads, head_dim] and the caches [num_blocks, block_size,
// num_kv_heads, head_dim] with num_kv_heads >= 1 dividing num_heads.
void check_tensors(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const std::vector<std::pair<const char*, torch::Tensor>>& index) {
  std::vector<std::pair<const char*, torch::Tensor>> all = {{"q", q}, {"k_cache", k_cache}, {"v_cache", v_cache}};
  all.insert(all.end(), index.begin(), index.end());
  for (const auto& [name, t] : all) {
    TORCH_CHECK(t.device().is_cpu(), name, " is on ", t.device(), ": the CPU kernels read host memory (use .cpu())");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (use .contiguous())");
  }
  for (const auto& [name, t] : index)
    TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(q.dim() == 3, "q must be [tokens, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got ", k_cache.sizes(),
              " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(3) == q.size(2), "q's head_dim (", q.size(2), ") differs from the caches' (", k_cache.size(3),
              ")");
  TORCH_CHECK(k_cache.size(2) >= 1 && q.size(1) % k_cache.size(2) == 0, "q's num_heads (", q.size(1),
              ") must be a multiple of the caches' num_kv_heads (", k_cache.size(2), "), which must be at least 1");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must have one dtype, got ", q.scalar_type(), ", ", k_cache.scalar_type(), " and ",
              v_cache.scalar_type());
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                               torch::Tensor context_lens, double scale, bool rowwise) {
  check_tensors(q, k_cache, v_cache, {{"block_tables", block_tables}, {"context_lens", context_lens}});
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "the decode kernel takes float32 or bfloat16, got ", q.scalar_type(), " (convert q and the caches)");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && context_lens.dim() == 1 &&
                  context_lens.size(0) == num_seqs, "one block-table row and one length per sequence: q has ", num_seqs,
              " rows, block_tables is ", block_tables.sizes(), ", context_lens ", context_lens.sizes());
  auto out = torch::empty_like(q);
  const int64_t max_blocks = block_tables.size(1);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (q.scalar_type() == at::kBFloat16 && (head_dim == 64 || head_dim == 128) && !rowwise) {
    using B = c10::BFloat16;
    (head_dim == 64 ? decode_rows<64> : decode_rows<128>)(
        static_cast<const B*>(q.data_ptr()), static_cast<const B*>(k_cache.data_ptr()),
        static_cast<const B*>(v_cache.data_ptr()), block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
        static_cast<B*>(out.data_ptr()), num_seqs, num_heads, num_kv_heads, block_size, max_blocks,
        static_cast<float>(scale));
    return out;
  }
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

// bfloat16 with head_dim 64 or 128 where AVX512-BF16 is compiled in: decode_rows (16 positions per step); otherwise
// decode_bf16_dot (bfloat16, head_dim a multiple of 32) or decode (float32 inside).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  return decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, false);
}

// The same without decode_rows: one dot product per position and head (the kernel before decode_rows, kept as the
// benchmarks' same-run baseline; WORKBENCH_CPU_DECODE_KERNEL=rowwise selects it in the cpu backend).
torch::Tensor paged_decode_attention_rowwise(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                             torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  return decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, true);
}

// Causal attention of query chunks over their paged context (see attend_chunks above); bfloat16, head_dim 64 or 128,
// and only where AVX512-BF16 is compiled in (chunk_kernel is False otherwise). The Python wrapper checks lengths.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor query_start, torch::Tensor context_lens, double scale) {
  check_tensors(q, k_cache, v_cache,
                {{"block_tables", block_tables}, {"query_start", query_start}, {"context_lens", context_lens}});
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "the chunk kernel takes bfloat16, got ", q.scalar_type());
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_seqs = context_lens.size(0);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && query_start.dim() == 1 &&
                  query_start.size(0) == num_seqs + 1, "one block-table row per sequence and num_seqs + 1 query starts: ",
              num_seqs, " context lengths, block_tables ", block_tables.sizes(), ", query_start ", query_start.sizes());
  auto out = torch::empty_like(q);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  using B = c10::BFloat16;
  auto run = [&](auto fn) {
    fn(static_cast<const B*>(q.data_ptr()), static_cast<const B*>(k_cache.data_ptr()),
       static_cast<const B*>(v_cache.data_ptr()), block_tables.data_ptr<int64_t>(), query_start.data_ptr<int64_t>(),
       context_lens.data_ptr<int64_t>(), static_cast<B*>(out.data_ptr()), num_seqs, num_heads, num_kv_heads,
       block_size, block_tables.size(1), static_cast<float>(scale));
  };
  if (head_dim == 64) {
    run(attend_chunks<64>);
    return out;
  }
  if (head_dim == 128) {
    run(attend_chunks<128>);
    return out;
  }
#endif
  TORCH_CHECK(false, "the chunk kernel needs AVX512-BF16 and head_dim 64 or 128");
  return out;
}

}  // namespace

void register_layer_ops(pybind11::module& m);  // cpu_layer_ops.cpp, built into the same extension

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_layer_ops(m);
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention on the CPU (see the file's head)");
  m.def("paged_decode_attention_rowwise", &paged_decode_attention_rowwise,
        "Paged decode attention, one dot product per position and head (the same-run baseline)");
  m.def("paged_attention", &paged_attention, "Causal attention of query chunks over a paged context, bfloat16");
  m.attr("bf16_dot_product") = kHaveBf16Dot;
}
