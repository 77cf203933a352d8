// Causal prompt attention (flash-style) on AVX-512 (AVX512-BF16 for the bf16 P V): one pass over the keys a
// query block can see, online softmax in fp32, no T x S score matrix.  Compiled with the
// avx512bf16 flags (CMakeLists.txt); flash_attn.cpp calls it on that tier and up.
//
// Two precisions: fp32 throughout (the default), or P V on bf16 pairs (bf16_pv, ~1.4x faster at
// 2k tokens, ~2e-3 relative error on the output from rounding p and v).
// Work item: one KV head g and a block of kQ query tokens, i.e. the G = H / Hkv query heads
// sharing g times kQ tokens = G * kQ rows.  Per block of kK keys the keys are transposed once
// into fp32 [D][kK] and the values packed into bf16 pairs [kK/2][D][2]; every group of 4 rows runs
//   S = Q K^T         fp32: 4 rows x 64 keys, 16 vfmadd per d (q broadcast),
//   online softmax    fp32: running max m, sum l, exp2 on the scores pre-scaled by log2(e),
//   O = a O + P V     4 rows x 64 d per pass: 16 vfmadd per key (p broadcast), or with bf16_pv 16
//                     vdpbf16ps per key pair on values packed into bf16 pairs [kK/2][D][2].
// The scores stay fp32 in both (bf16 q and k moved the logits of the tiny test models by up to
// 0.9 against llama.cpp's).
#include "flash_attn_impl.h"

#include "exp2_simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_features.h"

namespace kt {
namespace {

using namespace flash;
constexpr int kR = 4;  // rows per register tile

inline __m512 exp2_ps(__m512 x) { return exp2_ps512(x); }  // exp2_simd.h


struct Scratch : WorkRows {
  std::vector<uint16_t> vp;  // [kK/2][D][2]: bf16 value pairs (bf16 P V)
  alignas(64) uint16_t p[kR][kK];   // bf16 probabilities (bf16 P V)
  alignas(64) float pf[kR][kK];     // fp32 probabilities (fp32 P V)

  void size(const FlashArgs& a, int tokens = kQ) {
    WorkRows::size(a, tokens);
    vp.assign(static_cast<size_t>(a.D) * kK + 32, 0);
  }
};

// 16 floats -> 16 bf16 (round to nearest even), zero-extended into dword lanes.
inline __m512i bf16_lanes(const float* x, __mmask16 m) {
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x)));
}

// Keys / values [jl, jh] of block [j0, j0 + kK) of head g (zeros elsewhere): K transposed to fp32
// [D][kK], V as bf16 pairs [kK/2][D] dwords (keys 2 j2 and 2 j2 + 1 interleaved in registers).
template <bool kBf16>
void pack_kv(const FlashArgs& a, int g, int j0, int jl, int jh, Scratch& s) {
  const int D = a.D;
  const float* V = a.v + static_cast<size_t>(g) * a.kv_head;
  s.pack_keys(a, g, j0, jl, jh);
  if constexpr (!kBf16) return;  // fp32 P V reads the values in place
  uint32_t* vp = reinterpret_cast<uint32_t*>(s.vp.data());
  for (int j2 = 0; j2 < kK / 2; ++j2) {
    const int ja = j0 + 2 * j2, jb = ja + 1;
    const bool ia = ja >= jl && ja <= jh, ib = jb >= jl && jb <= jh;
    const __mmask16 ma = ia ? 0xFFFF : 0, mb = ib ? 0xFFFF : 0;
    const float* va = V + a.row(ia ? ja : jl);
    const float* vb = V + a.row(ib ? jb : jl);
    for (int d = 0; d < D; d += 16) {
      const __m512i w = _mm512_or_si512(bf16_lanes(va + d, ma), _mm512_slli_epi32(bf16_lanes(vb + d, mb), 16));
      _mm512_storeu_si512(reinterpret_cast<__m512i*>(vp + static_cast<size_t>(j2) * D + d), w);
    }
  }
}

// The item's rows (kv head g, query tokens [t0, t0 + nq)) over keys [jl, jh] of block [j0, j0 + kK):
// one step of each row's online softmax within the current chunk.
// noinline: one body serves the prompt and the decode rows (the same instructions for both)
template <bool kBf16>
__attribute__((noinline)) void attend_block(const FlashArgs& a, Scratch& s, int g, int t0, int nq, int j0, int jl, int jh) {
  const int D = a.D;
  pack_kv<kBf16>(a, g, j0, jl, jh, s);
  const float* kp = s.kp.data();
  const __m512i* vp = reinterpret_cast<const __m512i*>(s.vp.data());
  for (int r0 = 0; r0 < s.rows; r0 += kR) {
    int kl[kR], kh[kR];
    if (!visible_keys<kR>(a, s, t0, nq, jl, jh, r0, kl, kh)) continue;
    // S = Q K^T for 4 rows x 64 keys
    __m512 acc[kR][4];
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* qrow[kR];
    for (int r = 0; r < kR; ++r) qrow[r] = s.q.data() + static_cast<size_t>(r0 + r) * D;
    for (int d = 0; d < D; ++d) {
      const float* kd = kp + static_cast<size_t>(d) * kK;
      const __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16);
      const __m512 k2 = _mm512_loadu_ps(kd + 32), k3 = _mm512_loadu_ps(kd + 48);
      for (int r = 0; r < kR; ++r) {
        const __m512 qb = _mm512_set1_ps(qrow[r][d]);
        acc[r][0] = _mm512_fmadd_ps(k0, qb, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(k1, qb, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(k2, qb, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(k3, qb, acc[r][3]);
      }
    }
    // online softmax per row; keys a row does not see get probability 0 exactly
    float alpha[kR];
    for (int r = 0; r < kR; ++r) {
      const int row = r0 + r;
      if (kh[r] < kl[r]) {  // nothing visible here: keep the row as it is
        alpha[r] = 1.f;
        std::memset(s.p[r], 0, sizeof(s.p[r]));
        std::memset(s.pf[r], 0, sizeof(s.pf[r]));
        continue;
      }
      const __m512i jidx = _mm512_add_epi32(_mm512_set1_epi32(j0), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      __m512 mx = _mm512_set1_ps(kMasked);
      __mmask16 ok[4];
      for (int c = 0; c < 4; ++c) {
        const __m512i j = _mm512_add_epi32(jidx, _mm512_set1_epi32(16 * c));
        ok[c] = _mm512_cmpge_epi32_mask(j, _mm512_set1_epi32(kl[r])) & _mm512_cmple_epi32_mask(j, _mm512_set1_epi32(kh[r]));
        acc[r][c] = _mm512_mask_blend_ps(ok[c], _mm512_set1_ps(kMasked), acc[r][c]);
        mx = _mm512_max_ps(mx, acc[r][c]);
      }
      const float m_old = s.m[row], m_new = std::max(m_old, _mm512_reduce_max_ps(mx));
      alpha[r] = std::isinf(m_old) ? 0.f : std::exp2(m_old - m_new);
      s.m[row] = m_new;
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; c += 2) {
        const __m512 p0 = _mm512_maskz_mov_ps(ok[c], exp2_ps(_mm512_sub_ps(acc[r][c], mv)));
        const __m512 p1 = _mm512_maskz_mov_ps(ok[c + 1], exp2_ps(_mm512_sub_ps(acc[r][c + 1], mv)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        if constexpr (kBf16) {
          const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);
          _mm512_storeu_si512(reinterpret_cast<__m512i*>(s.p[r] + 16 * c), (__m512i)pb);
        } else {
          _mm512_storeu_ps(s.pf[r] + 16 * c, p0);
          _mm512_storeu_ps(s.pf[r] + 16 * c + 16, p1);
        }
      }
      s.l[row] = s.l[row] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    // O = alpha O + P V, 64 d per pass, over the keys [jl, jh] (the pairs holding them with bf16)
    const int32_t* prow[kR];
    for (int r = 0; r < kR; ++r) prow[r] = reinterpret_cast<const int32_t*>(s.p[r]);
    for (int dh = 0; dh < D; dh += 64) {
      __m512 o[kR][4];
      for (int r = 0; r < kR; ++r) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
        float* orow = s.o.data() + static_cast<size_t>(r0 + r) * D + dh;
        for (int c = 0; c < 4; ++c) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * c), al);
      }
      if constexpr (!kBf16) {
        const float* V = a.v + static_cast<size_t>(g) * a.kv_head + dh;
        for (int j = jl - j0; j <= jh - j0; ++j) {
          const float* vr = V + a.row(j0 + j);
          const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
          const __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
          for (int r = 0; r < kR; ++r) {
            const __m512 pb = _mm512_set1_ps(s.pf[r][j]);
            o[r][0] = _mm512_fmadd_ps(v0, pb, o[r][0]);
            o[r][1] = _mm512_fmadd_ps(v1, pb, o[r][1]);
            o[r][2] = _mm512_fmadd_ps(v2, pb, o[r][2]);
            o[r][3] = _mm512_fmadd_ps(v3, pb, o[r][3]);
          }
        }
      } else {
        for (int j2 = (jl - j0) / 2; j2 <= (jh - j0) / 2; ++j2) {
          const __m512i* vd = vp + (static_cast<size_t>(j2) * D + dh) / 16;
          const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vd), v1 = (__m512bh)_mm512_loadu_si512(vd + 1);
          const __m512bh v2 = (__m512bh)_mm512_loadu_si512(vd + 2), v3 = (__m512bh)_mm512_loadu_si512(vd + 3);
          for (int r = 0; r < kR; ++r) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(prow[r][j2]);
            o[r][0] = _mm512_dpbf16_ps(o[r][0], v0, pb);
            o[r][1] = _mm512_dpbf16_ps(o[r][1], v1, pb);
            o[r][2] = _mm512_dpbf16_ps(o[r][2], v2, pb);
            o[r][3] = _mm512_dpbf16_ps(o[r][3], v3, pb);
          }
        }
      }
      for (int r = 0; r < kR; ++r) {
        float* orow = s.o.data() + static_cast<size_t>(r0 + r) * D + dh;
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(orow + 16 * c, o[r][c]);
      }
    }
  }
}

}  // namespace

void flash_attn_prefill_avx512(ThreadPool& pool, const FlashArgs& a, bool bf16_pv) {
  run_items<Scratch>(pool, a, [&](Scratch& s, int g, int t0, int nq) {
    if (bf16_pv) prompt_item(a, g, t0, nq, s, attend_block<true>);
    else prompt_item(a, g, t0, nq, s, attend_block<false>);
  });
}

void flash_decode_chunk_avx512(const FlashArgs& a, int g, int c0, bool bf16_pv, float* part) {
  thread_local Scratch s;
  if (s.qn != 1 || s.rows < a.H / a.Hkv || s.kp.size() != static_cast<size_t>(a.D) * kK) s.size(a, 1);
  if (bf16_pv) decode_chunk(a, g, c0, s, part, attend_block<true>);
  else decode_chunk(a, g, c0, s, part, attend_block<false>);
}

}  // namespace kt
