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
// rows are read where they lie, 16 positions at a time, with an online softmax (Dao et al., FlashAttention, 2022,
// Algorithm 1; Milakov & Gimelshein, 2018) kept in float32 per (row, head).
//   - q·k: vdpbf16ps on the bfloat16 rows as stored, 16 positions' partial sums reduced together by one
//     shuffle tree (45 instructions for 16 dot products, where one horizontal sum each takes about 8);
//   - p·V: p rounded to bfloat16 (as SDPA's bfloat16 CPU kernel does) and vdpbf16ps on V's rows interleaved in
//     pairs of positions, built once per 16 positions and KV head and shared by the group's heads and the tile's rows.
// Work is split into (sequence, tile of up to kTileRows query rows) jobs, longest first, handed out dynamically:
// one long prompt and many decodes share a step.
constexpr int64_t kTileRows = 8;
constexpr int64_t kAhead = 32;  // how far ahead to prefetch, in positions (16 and 48 were no better, within noise)
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

struct ChunkJob {
  int64_t seq, row0, rows, cost;
};

// One job: rows row0 .. row0+rows-1 of sequence seq, every head. D = head_dim (a multiple of 32).
template <int D>
void attend_rows(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                 const int64_t* table, int64_t qbase, int64_t qlen, int64_t ctx, const ChunkJob& job,
                 c10::BFloat16* out, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
                 float* state /* rows * num_heads * (D + 2) floats */, __m512i* vv /* 8 * D / 16 vectors */) {
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
  const B* kp[16];
  const B* vp[16];
  alignas(64) uint32_t pj[8];
  for (int64_t t0 = 0; t0 <= last_pos; t0 += 16) {
    const int64_t nt = std::min<int64_t>(16, ctx - t0);
    for (int64_t j = 0; j < 16; ++j) {  // positions past the context read the last one (masked below)
      const int64_t t = t0 + std::min<int64_t>(j, nt - 1);
      const int64_t slot = table[t / block_size] * block_size + t % block_size;
      kp[j] = k_cache + slot * row;
      vp[j] = v_cache + slot * row;
    }
    // Ask now for the K/V rows of the 16 positions kAhead further on: blocks lie anywhere in the pool, so the
    // hardware prefetcher cannot guess the next one, and a long context streams from memory.
    for (int64_t t = t0 + kAhead; t < std::min(t0 + kAhead + 16, last_pos + 1); ++t) {
      const int64_t slot = table[t / block_size] * block_size + t % block_size;
      const char* kn = reinterpret_cast<const char*>(k_cache + slot * row);
      const char* vn = reinterpret_cast<const char*>(v_cache + slot * row);
      for (int64_t b = 0; b < row * 2; b += 64) {
        _mm_prefetch(kn + b, _MM_HINT_T0);
        _mm_prefetch(vn + b, _MM_HINT_T0);
      }
    }
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      // V's rows in pairs of positions, interleaved (v[2i][d], v[2i+1][d]) so that one vdpbf16ps adds two
      // positions' p·v to 16 dims; within a 128-bit lane unpack takes dims 8k..8k+3 (lo) and 8k+4..8k+7 (hi).
      for (int jp = 0; jp < 8; ++jp)
        for (int c = 0; c < NQ; ++c) {
          const __m512i a = _mm512_loadu_si512(vp[2 * jp] + h * D + c * 32);
          const __m512i b = _mm512_loadu_si512(vp[2 * jp + 1] + h * D + c * 32);
          vv[jp * NF + 2 * c] = _mm512_unpacklo_epi16(a, b);
          vv[jp * NF + 2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
      for (int64_t r = 0; r < job.rows; ++r) {
        const int64_t pos = first_pos + r;
        if (t0 > pos) continue;  // this row sees none of these positions
        const int64_t nvalid = std::min<int64_t>(nt, pos - t0 + 1);
        const __mmask16 valid = static_cast<__mmask16>((1u << nvalid) - 1u);
        const B* qrow = q + (qbase + job.row0 + r) * num_heads * D;
        for (int64_t hq = h * g; hq < (h + 1) * g; ++hq) {
          __m512i qv[NQ];
          for (int c = 0; c < NQ; ++c) qv[c] = _mm512_loadu_si512(qrow + hq * D + c * 32);
          __m512 dots[16];
          for (int j = 0; j < 16; ++j) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < NQ; ++c)
              a = _mm512_dpbf16_ps(a, (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512(kp[j] + h * D + c * 32));
            dots[kSlot[j]] = a;
          }
          __m512 s = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
          s = _mm512_mask_mov_ps(_mm512_set1_ps(kMasked), valid, s);
          float* st = state + (r * num_heads + hq) * stride;
          const float m_old = st[D];
          const float m_new = std::max(m_old, _mm512_reduce_max_ps(s));
          const float corr = std::exp(m_old - m_new);
          const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
          st[D] = m_new;
          st[D + 1] = st[D + 1] * corr + _mm512_reduce_add_ps(p);
          _mm256_store_si256(reinterpret_cast<__m256i*>(pj), (__m256i)_mm512_cvtneps_pbh(p));  // p in bfloat16
          __m512 acc[NF];
          for (int c = 0; c < NF; ++c) acc[c] = _mm512_mul_ps(_mm512_loadu_ps(st + c * 16), _mm512_set1_ps(corr));
          for (int64_t jp = 0; jp < (nvalid + 1) / 2; ++jp) {
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
      const float inv = 1.f / st[D + 1];
      for (int64_t i = 0; i < D; ++i) {  // accumulator lane i holds dim c*32 + 8k + 4*half + m (see the unpack)
        const int64_t x = i / 16, lane = i % 16, k = lane / 4, m = lane % 4;
        o[hq * D + (x / 2) * 32 + 8 * k + 4 * (x % 2) + m] = B(st[i] * inv);
      }
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
    __m512i vv[8 * D / 16];
    for (int64_t i = next++; i < njobs; i = next++) {
      const ChunkJob& job = jobs[i];
      const int64_t qbase = query_start[job.seq];
      attend_rows<D>(q, k_cache, v_cache, block_tables + job.seq * max_blocks, qbase,
                     query_start[job.seq + 1] - qbase, context_lens[job.seq], job, out, num_heads, num_kv_heads,
                     block_size, scale, state.data(), vv);
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


// Causal attention of query chunks over their paged context (see attend_chunks above); bfloat16, head_dim 64 or 128,
// and only where AVX512-BF16 is compiled in (chunk_kernel is False otherwise). The Python wrapper checks lengths.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor query_start, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [num_tokens, num_heads, head_dim] and the caches [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "q and the caches must be bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong, "block_tables, query_start and context_lens must be int64");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
                  query_start.is_contiguous() && context_lens.is_contiguous(), "every tensor must be contiguous");
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_seqs = context_lens.size(0);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head_dim or head counts do not match");
  TORCH_CHECK(block_tables.size(0) == num_seqs && query_start.size(0) == num_seqs + 1,
              "one block table and length per sequence, and num_seqs + 1 query starts");
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
  m.def("paged_attention", &paged_attention, "Causal attention of query chunks over a paged context, bfloat16");
  m.attr("bf16_dot_product") = kHaveBf16Dot;
}
