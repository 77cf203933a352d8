// Causal prompt attention (flash-style) on AVX2 + FMA, fp32 throughout: the tiers below AVX-512
// (Zen 3, Alder Lake) read a prompt with the same algorithm as flash_attn_avx512.inc.
// Compiled with the AVX2 flags (CMakeLists.txt); flash_attn.cpp calls it on those tiers.
//
// Work item: one KV head g and a block of kQ query tokens (the G = H / Hkv query heads sharing g,
// times kQ tokens).  Per block of kK keys at an absolute multiple of kK the keys are transposed
// once into fp32 [D][kK]; every pair of rows runs
//   S = Q K^T         4 ymm of keys x 2 rows per pass (two passes per block), 8 vfmadd per d,
//   online softmax    running max m, sum l, exp2 on the scores pre-scaled by log2(e),
//   O = a O + P V     2 rows x 32 d per pass, the values read in place (a cache or a page pool).
// A row's arithmetic never depends on the rows beside it, the chunk it came in or where its keys
// sit: a score is one fma chain over d, a block's softmax sees that row's scores alone.
#include "flash_attn_impl.h"

#include "exp2_simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kt {
namespace {

using namespace flash;
constexpr int kR = 2;  // rows per register tile

constexpr int kDc = 128;  // key columns per pass of the score product

struct Scratch : WorkRows {
  std::vector<float> sc;      // [rows][kK]: the scores of the block (partial sums between column passes)
  std::vector<float> pf;      // [rows][kK]: probabilities of the block
  std::vector<float> alpha;   // [rows]: the factor on a row's O before this block's P V
  std::vector<uint8_t> live;  // [rows / kR]: some row of the pair sees a key of the block
  std::vector<int> kl, kh;    // [rows]: the keys of the block each row sees

  void size(const FlashArgs& a, int tokens = kQ) {
    WorkRows::size(a, tokens);
    sc.assign(static_cast<size_t>(rows) * kK, 0.f);
    pf.assign(static_cast<size_t>(rows) * kK, 0.f);
    alpha.assign(rows, 1.f);
    live.assign(rows / kR + 1, 0);
    kl.assign(rows, 0);
    kh.assign(rows, -1);
  }
};

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// The item's rows (kv head g, query tokens [t0, t0 + nq)) over keys [jl, jh] of block [j0, j0 + kK):
// one step of each row's online softmax within the current chunk, in three passes over the rows
// (as flash_attn_avx512.inc): the scores kDc key columns at a time for every row (partial sums in
// s.sc), so the transposed keys' slice stays in L1 whatever D; the softmax per row; P V 32 value
// columns at a time for every row.  Each output is one fixed chain of fmas whatever the passes.
// noinline: one body serves the prompt and the decode rows (the same instructions for both)
__attribute__((noinline)) void attend_block(const FlashArgs& a, Scratch& s, int g, int t0, int nq, int j0, int jl, int jh) {
  const int D = a.D, Dv = a.dv();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  s.pack_keys(a, g, j0, jl, jh);
  const float* kp = s.kp.data();
  bool any = false;
  for (int r0 = 0; r0 < s.rows; r0 += kR) {
    s.live[r0 / kR] = visible_keys<kR>(a, s, t0, nq, jl, jh, r0, &s.kl[r0], &s.kh[r0]);
    any |= s.live[r0 / kR] != 0;
  }
  if (!any) return;
  for (int d0 = 0; d0 < D; d0 += kDc) {  // S = Q K^T, kDc columns and 32 keys per pass
    const int d1 = std::min(D, d0 + kDc);
    for (int r0 = 0; r0 < s.rows; r0 += kR) {
      if (!s.live[r0 / kR]) continue;
      const float* qrow[kR];
      for (int r = 0; r < kR; ++r) qrow[r] = s.q.data() + static_cast<size_t>(r0 + r) * D;
      for (int half = 0; half < 2; ++half) {
        __m256 acc[kR][4];
        float* sc = s.sc.data() + static_cast<size_t>(r0) * kK + half * 32;
        for (int r = 0; r < kR; ++r)
          for (int c = 0; c < 4; ++c) acc[r][c] = d0 ? _mm256_loadu_ps(sc + r * kK + 8 * c) : _mm256_setzero_ps();
        for (int d = d0; d < d1; ++d) {
          const float* kd = kp + static_cast<size_t>(d) * kK + half * 32;
          const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8);
          const __m256 k2 = _mm256_loadu_ps(kd + 16), k3 = _mm256_loadu_ps(kd + 24);
          for (int r = 0; r < kR; ++r) {
            const __m256 qb = _mm256_set1_ps(qrow[r][d]);
            acc[r][0] = _mm256_fmadd_ps(k0, qb, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(k1, qb, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(k2, qb, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(k3, qb, acc[r][3]);
          }
        }
        for (int r = 0; r < kR; ++r)
          for (int c = 0; c < 4; ++c) _mm256_storeu_ps(sc + r * kK + 8 * c, acc[r][c]);
      }
    }
  }
  for (int row = 0; row < s.rows; ++row) {  // online softmax per row
    if (!s.live[row / kR]) continue;
    const int kl = s.kl[row], kh = s.kh[row];
    float* prow = s.pf.data() + static_cast<size_t>(row) * kK;
    if (kh < kl) {  // nothing visible here: keep the row as it is
      s.alpha[row] = 1.f;
      std::memset(prow, 0, kK * sizeof(float));
      continue;
    }
    __m256 mx = _mm256_set1_ps(kMasked);
    float* sr = s.sc.data() + static_cast<size_t>(row) * kK;
    for (int c = 0; c < 8; ++c) {
      const __m256i j = _mm256_add_epi32(_mm256_set1_epi32(j0 + 8 * c), lane);
      const __m256i ok = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(kl), j),
                                             _mm256_andnot_si256(_mm256_cmpgt_epi32(j, _mm256_set1_epi32(kh)),
                                                                 _mm256_set1_epi32(-1)));
      const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(kMasked), _mm256_loadu_ps(sr + 8 * c), _mm256_castsi256_ps(ok));
      _mm256_storeu_ps(sr + 8 * c, v);
      mx = _mm256_max_ps(mx, v);
    }
    const float m_old = s.m[row], m_new = std::max(m_old, hmax(mx));
    const float al = std::isinf(m_old) ? 0.f : std::exp2(m_old - m_new);
    s.alpha[row] = al;
    s.m[row] = m_new;
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    const __m256 masked = _mm256_set1_ps(kMasked);
    for (int c = 0; c < 8; c += 2) {  // keys the row does not see: probability 0 exactly
      const __m256 s0 = _mm256_loadu_ps(sr + 8 * c), s1 = _mm256_loadu_ps(sr + 8 * c + 8);
      const __m256 p0 = _mm256_andnot_ps(_mm256_cmp_ps(s0, masked, _CMP_EQ_OQ), exp2_ps256(_mm256_sub_ps(s0, mv)));
      const __m256 p1 = _mm256_andnot_ps(_mm256_cmp_ps(s1, masked, _CMP_EQ_OQ), exp2_ps256(_mm256_sub_ps(s1, mv)));
      sum = _mm256_add_ps(sum, _mm256_add_ps(p0, p1));
      _mm256_storeu_ps(prow + 8 * c, p0);
      _mm256_storeu_ps(prow + 8 * c + 8, p1);
    }
    s.l[row] = s.l[row] * al + hsum(sum);
  }
  const float* V = a.v + static_cast<size_t>(g) * a.kv_head;
  for (int dh = 0; dh < Dv; dh += 32) {  // O = alpha O + P V, 32 d per pass over every row
    for (int r0 = 0; r0 < s.rows; r0 += kR) {
      if (!s.live[r0 / kR]) continue;
      const float* pfr[kR];
      __m256 o[kR][4];
      for (int r = 0; r < kR; ++r) {
        pfr[r] = s.pf.data() + static_cast<size_t>(r0 + r) * kK;
        const __m256 al = _mm256_set1_ps(s.alpha[r0 + r]);
        float* orow = s.o.data() + static_cast<size_t>(r0 + r) * Dv + dh;
        for (int c = 0; c < 4; ++c) o[r][c] = _mm256_mul_ps(_mm256_loadu_ps(orow + 8 * c), al);
      }
      for (int j = jl - j0; j <= jh - j0; ++j) {
        const float* vr = V + a.row(j0 + j) + dh;
        const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
        const __m256 v2 = _mm256_loadu_ps(vr + 16), v3 = _mm256_loadu_ps(vr + 24);
        for (int r = 0; r < kR; ++r) {
          const __m256 pb = _mm256_set1_ps(pfr[r][j]);
          o[r][0] = _mm256_fmadd_ps(v0, pb, o[r][0]);
          o[r][1] = _mm256_fmadd_ps(v1, pb, o[r][1]);
          o[r][2] = _mm256_fmadd_ps(v2, pb, o[r][2]);
          o[r][3] = _mm256_fmadd_ps(v3, pb, o[r][3]);
        }
      }
      for (int r = 0; r < kR; ++r) {
        float* orow = s.o.data() + static_cast<size_t>(r0 + r) * Dv + dh;
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(orow + 8 * c, o[r][c]);
      }
    }
  }
}

}  // namespace

void flash_attn_prefill_avx2(ThreadPool& pool, const FlashArgs& a) {
  run_items<Scratch>(pool, a, [&](Scratch& s, int g, int t0, int nq) { prompt_item(a, g, t0, nq, s, attend_block); });
}

void head_rows_avx2(const float* x, size_t x_tok, size_t x_head, const float* W, int K, int N, float* out,
                    size_t o_tok, size_t o_head, int h, int t0, int nt) {
  flash::head_rows(x, x_tok, x_head, W, K, N, out, o_tok, o_head, h, t0, nt);
}

void flash_decode_chunk_avx2(const FlashArgs& a, int g, int c0, float* part) {
  thread_local Scratch s;
  if (!s.fits_decode(a)) s.size(a, 1);
  decode_chunk(a, g, c0, s, part, attend_block);
}

}  // namespace kt
