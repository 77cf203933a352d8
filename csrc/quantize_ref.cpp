// K-quant and IQ4 row quantizers (see quantize_ref.h).  The searches follow llama.cpp's published
// reference algorithms (weighted least-squares scale/min search over a few candidate grids),
// block layouts are ggml's; the Python twin is ktransformers/weights/quantize.py.
#include "quantize_ref.h"

#include "ggml_types.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kt {
namespace {

// The block quantizers are compiled twice, for AVX2 and for the x86-64 baseline, and the loader
// picks one (GCC function multi-versioning); the searches are inlined into each, so their 8-lane
// loops run 8 floats wide where the CPU has AVX2.  No FMA: the bytes stay the same either way.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define KT_QUANT_CLONES __attribute__((target_clones("avx2", "default")))
#define KT_QUANT_INLINE __attribute__((always_inline)) inline
#else
#define KT_QUANT_CLONES
#define KT_QUANT_INLINE inline
#endif

constexpr int QK = 256;
constexpr float GROUP_EPS = 1e-15f;

// round half to even, like ggml's nearest_int: adding 1.5 * 2^23 leaves the rounded integer in the
// low mantissa bits (exact for |v| < 2^22; larger values saturate, then clamp as before); inline, so the
// candidate loops vectorise instead of calling libm per value
inline int nearest(float v) {
  const float t = std::min(std::max(v, -4194303.f), 4194303.f) + 12582912.f;  // huge ratios still clamp
  int32_t i;
  std::memcpy(&i, &t, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// float -> IEEE half bits, round to nearest even
uint16_t to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (x < 0x38800000u) {                                                // subnormal or zero half
    if (x < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // value / 2^-24 = mantissa(24 bits) * 2^(e - 126)
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((x - 0x38000000u) >> 13);
  const uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float from_half(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ffu, x;
  if (e == 0) {
    if (m == 0) {
      x = sign;
    } else {  // subnormal
      e = 127 - 15 + 1;
      while (!(m & 0x400u)) { m <<= 1; --e; }
      x = sign | (e << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (e == 31) {
    x = sign | 0x7f800000u | (m << 13);
  } else {
    x = sign | ((e + 127 - 15) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

inline float round_half(float v) { return from_half(to_half(v)); }

// symmetric scale of n values, q in [-nmax, nmax - 1], x^2-weighted search over 19 grids
KT_QUANT_INLINE float search_scale_sym(int n, int nmax, const float* x, int8_t* L) {
  float mx = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > amax) { amax = a; mx = x[i]; }
  }
  if (amax < GROUP_EPS) {
    std::memset(L, 0, n);
    return 0.f;
  }
  auto sums = [&](float isc, float& sxl, float& sl2) {
    sxl = sl2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest(isc * x[i]), -nmax, nmax - 1);
      const float w = x[i] * x[i];
      sxl += w * x[i] * l;
      sl2 += w * l * l;
    }
  };
  auto fill = [&](float isc) {
    for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(std::clamp(nearest(isc * x[i]), -nmax, nmax - 1));
  };
  float iscale = -nmax / mx, sxl, sl2;
  sums(iscale, sxl, sl2);
  fill(iscale);
  float scale = sl2 > 0 ? sxl / sl2 : 0.f, best = scale * sxl;
  for (int s = -9; s <= 9; ++s) {
    if (s == 0) continue;
    const float isc = -(nmax + 0.1f * s) / mx;
    sums(isc, sxl, sl2);
    if (sl2 > 0 && sxl * sxl > best * sl2) {
      fill(isc);
      scale = sxl / sl2;
      best = scale * sxl;
    }
  }
  return scale;
}

inline float rnd(float v) { return (v + 12582912.f) - 12582912.f; }  // half to even, |v| < 2^22

// Scale and min (dequant = scale * q - min, min >= 0, q in [0, nmax]) of the 8 sub-blocks of 32
// of one block at once, weighted by w: lane j is sub-block j, each lane does the scalar search's
// arithmetic in the reference order (so the bytes equal the reference quantizer's),
// and the loops over lanes vectorise without reassociating any sum.
KT_QUANT_INLINE void search_scale_min8(int nmax, const float* x, const float* w, uint8_t* L, float* scale, float* the_min,
                       float rmin, float rdelta, int nstep) {
  constexpr int J = 8, N = 32;
  float xt[N][J], wt[N][J], Lf[N][J], La[N][J];
  for (int j = 0; j < J; ++j)
    for (int i = 0; i < N; ++i) { xt[i][j] = x[N * j + i]; wt[i][j] = w[N * j + i]; }
  float mn[J], mx[J], sw[J], sx[J], sc[J], best[J];
  bool flat[J];
  for (int j = 0; j < J; ++j) { mn[j] = mx[j] = xt[0][j]; sw[j] = wt[0][j]; sx[j] = wt[0][j] * xt[0][j]; }
  for (int i = 1; i < N; ++i)
    for (int j = 0; j < J; ++j) {
      mn[j] = std::min(mn[j], xt[i][j]);
      mx[j] = std::max(mx[j], xt[i][j]);
      sw[j] += wt[i][j];
      sx[j] += wt[i][j] * xt[i][j];
    }
  const float fmax_q = static_cast<float>(nmax);
  float is0[J];
  for (int j = 0; j < J; ++j) {
    if (mn[j] > 0) mn[j] = 0;
    flat[j] = mx[j] == mn[j];
    is0[j] = flat[j] ? 0.f : fmax_q / (mx[j] - mn[j]);
    sc[j] = flat[j] ? 0.f : 1.f / is0[j];
    best[j] = 0;
  }
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < J; ++j) {
      const float l = rnd(std::min(std::max(is0[j] * (xt[i][j] - mn[j]), 0.f), fmax_q));
      Lf[i][j] = l;
      float d = sc[j] * l + mn[j] - xt[i][j];
      d = d * d;
      best[j] += wt[i][j] * d;
    }
  for (int s = 0; s <= nstep; ++s) {
    float isc[J], sl[J], sl2[J], sxl[J], ts[J], tm[J], err[J];
    bool upd[J];
    for (int j = 0; j < J; ++j) {
      isc[j] = flat[j] ? 0.f : (rmin + rdelta * s + fmax_q) / (mx[j] - mn[j]);
      sl[j] = sl2[j] = sxl[j] = 0;
    }
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < J; ++j) {
        const float l = rnd(std::min(std::max(isc[j] * (xt[i][j] - mn[j]), 0.f), fmax_q));
        La[i][j] = l;
        const float wl = wt[i][j] * l;
        sl[j] += wl;
        sl2[j] += wl * l;
        sxl[j] += wl * xt[i][j];
      }
    for (int j = 0; j < J; ++j) {
      const float D = sw[j] * sl2[j] - sl[j] * sl[j];
      const bool ok = D > 0 && !flat[j];
      const float Ds = ok ? D : 1.f;
      float a = (sw[j] * sxl[j] - sx[j] * sl[j]) / Ds, b = (sl2[j] * sx[j] - sl[j] * sxl[j]) / Ds;
      if (b > 0) {
        b = 0;
        a = sxl[j] / (sl2[j] > 0 ? sl2[j] : 1.f);
      }
      ts[j] = a;
      tm[j] = b;
      err[j] = 0;
      upd[j] = ok;
    }
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < J; ++j) {
        float d = ts[j] * La[i][j] + tm[j] - xt[i][j];
        d = d * d;
        err[j] += wt[i][j] * d;
      }
    bool any = false;
    for (int j = 0; j < J; ++j) {
      upd[j] = upd[j] && err[j] < best[j];
      any |= upd[j];
    }
    if (!any) continue;
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < J; ++j) Lf[i][j] = upd[j] ? La[i][j] : Lf[i][j];
    for (int j = 0; j < J; ++j)
      if (upd[j]) { best[j] = err[j]; sc[j] = ts[j]; mn[j] = tm[j]; }
  }
  for (int j = 0; j < J; ++j) {
    scale[j] = sc[j];
    the_min[j] = -mn[j];
    for (int i = 0; i < N; ++i) L[N * j + i] = flat[j] ? 0 : static_cast<uint8_t>(Lf[i][j]);
  }
}

// Q4_K (nmax 15) / Q5_K (nmax 31): 8 sub-blocks of 32, 6-bit scales and mins
KT_QUANT_CLONES void block_q45(const float* x, uint8_t* out, bool five) {
  const int nmax = five ? 31 : 15;
  uint8_t L[QK], Laux[32], sc6[12] = {0};
  float w[32], mins[8], scales[8], max_scale = 0, max_min = 0;
  float wall[QK];
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float s2 = 0;
    for (int l = 0; l < 32; ++l) s2 += xs[l] * xs[l];
    const float av = std::sqrt(s2 / 32);
    for (int l = 0; l < 32; ++l) wall[32 * j + l] = av + std::fabs(xs[l]);
  }
  (void)w;
  (void)Laux;
  search_scale_min8(nmax, x, wall, L, scales, mins, five ? -0.5f : -1.f, 0.1f, five ? 15 : 20);
  for (int j = 0; j < 8; ++j) {
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_s = max_scale > 0 ? 63.f / max_scale : 0.f, inv_m = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    ls[j] = static_cast<uint8_t>(std::min(63, nearest(inv_s * scales[j])));
    lm[j] = static_cast<uint8_t>(std::min(63, nearest(inv_m * mins[j])));
    if (j < 4) {
      sc6[j] = ls[j];
      sc6[j + 4] = lm[j];
    } else {
      sc6[j + 4] = static_cast<uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      sc6[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
      sc6[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
    }
  }
  const uint16_t dh = to_half(max_scale / 63.f), mh = to_half(max_min / 63.f);
  const float d = from_half(dh), dm = from_half(mh);
  for (int j = 0; j < 8; ++j) {
    const float dd = d * ls[j];
    if (dd == 0.f) continue;
    const float m = dm * lm[j];
    for (int i = 0; i < 32; ++i) L[32 * j + i] = static_cast<uint8_t>(std::clamp(nearest((x[32 * j + i] + m) / dd), 0, nmax));
  }
  std::memcpy(out, &dh, 2);
  std::memcpy(out + 2, &mh, 2);
  std::memcpy(out + 4, sc6, 12);
  uint8_t* q = out + 16;
  if (five) {
    uint8_t* qh = q;  // 32 bytes of high bits, then 128 of low nibbles
    uint8_t* ql = q + 32;
    std::memset(qh, 0, 32);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QK; n += 64) {
      for (int j = 0; j < 32; ++j) {
        int l1 = L[n + j], l2 = L[n + j + 32];
        if (l1 > 15) { l1 -= 16; qh[j] |= m1; }
        if (l2 > 15) { l2 -= 16; qh[j] |= m2; }
        ql[j] = static_cast<uint8_t>(l1 | (l2 << 4));
      }
      m1 = static_cast<uint8_t>(m1 << 2);
      m2 = static_cast<uint8_t>(m2 << 2);
      ql += 32;
    }
  } else {
    for (int j = 0; j < QK; j += 64, q += 32)
      for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
  }
}

// Q6_K: 16 sub-blocks of 16, 8-bit scales; layout ql[128] qh[64] scales[16] d
KT_QUANT_CLONES void q_q6_K(const float* x, uint8_t* out) {
  int8_t Ls[QK];
  uint8_t L[QK];
  float scales[16], max_scale = 0, max_abs = 0;
  for (int ib = 0; ib < 16; ++ib) {
    scales[ib] = search_scale_sym(16, 32, x + 16 * ib, Ls + 16 * ib);
    const float a = std::fabs(scales[ib]);
    if (a > max_abs) { max_abs = a; max_scale = scales[ib]; }
  }
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  int8_t* sc = reinterpret_cast<int8_t*>(out + 192);
  if (max_abs < GROUP_EPS) {
    std::memset(out, 0, 210);
    return;
  }
  const float iscale = -128.f / max_scale;
  const uint16_t dh = to_half(1.f / iscale);
  std::memcpy(out + 208, &dh, 2);
  const float d = from_half(dh);
  for (int ib = 0; ib < 16; ++ib) sc[ib] = static_cast<int8_t>(std::min(127, nearest(iscale * scales[ib])));
  for (int j = 0; j < 16; ++j) {
    const float dd = d * sc[j];
    if (dd == 0.f) {
      for (int i = 0; i < 16; ++i) L[16 * j + i] = 32;
      continue;
    }
    for (int i = 0; i < 16; ++i) L[16 * j + i] = static_cast<uint8_t>(std::clamp(nearest(x[16 * j + i] / dd), -32, 31) + 32);
  }
  for (int j = 0; j < QK; j += 128, ql += 64, qh += 32) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t a = L[j + l], b = L[j + l + 32], c = L[j + l + 64], e = L[j + l + 96];
      ql[l] = static_cast<uint8_t>((a & 0xF) | ((c & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((b & 0xF) | ((e & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
    }
  }
}

// ---- IQ4_NL / IQ4_XS: 4-bit indices into a fixed non-linear code book (ggml's kvalues_iq4nl)

constexpr float kNL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// the midpoints between neighbouring codes: the nearest code of v is the number of midpoints <= v
constexpr float kNLMid[15] = {-115.5f, -93.5f, -74.f, -57.f, -42.f, -28.5f, -16.f, -4.5f,
                              7.f, 19.f, 31.5f, 45.5f, 61.f, 79.f, 101.f};

inline int nearest_code(float v) {
  int idx = 0;
  for (int k = 0; k < 15; ++k) idx += v >= kNLMid[k];
  return idx;
}

// Scale d of the 32 values at x so that x ~= d * kNL[L] (x^2-weighted least squares, no importance
// matrix).  Candidate inverse scales put the largest-magnitude value on the code book's far end,
// then 15 steps around it on the other (signed) side; each candidate's codes are refit by least
// squares and the refit with the smallest weighted error wins.
KT_QUANT_INLINE float search_scale_nl(const float* x) {
  constexpr int N = 32;
  float amax = 0, mx = 0;
  for (int i = 0; i < N; ++i) {
    const float a = std::fabs(x[i]);
    if (a > amax) { amax = a; mx = x[i]; }
  }
  if (amax < GROUP_EPS) return 0.f;
  float w[N];
  for (int i = 0; i < N; ++i) w[i] = x[i] * x[i];
  auto fit = [&](float isc, float& sqx, float& sq2) {
    sqx = sq2 = 0;
    for (int i = 0; i < N; ++i) {
      const float q = kNL[nearest_code(isc * x[i])];
      sqx += w[i] * q * x[i];
      sq2 += w[i] * q * q;
    }
  };
  float sqx, sq2;
  fit(-kNL[0] / mx, sqx, sq2);
  float d = sq2 > 0 ? sqx / sq2 : 0.f, best = d * sqx;
  for (int t = -7; t <= 7; ++t) {
    fit((t + kNL[0]) / mx, sqx, sq2);
    if (sq2 > 0 && sqx * sqx > best * sq2) {
      d = sqx / sq2;
      best = d * sqx;
    }
  }
  return d;
}

// the 32 codes of x for the stored scale d, packed two per byte (value j low nibble, j + 16 high)
KT_QUANT_INLINE void pack_codes_nl(const float* x, float d, uint8_t* qs) {
  const float id = d != 0.f ? 1.f / d : 0.f;
  uint8_t L[32];
  for (int i = 0; i < 32; ++i) L[i] = static_cast<uint8_t>(nearest_code(id * x[i]));
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>(L[j] | (L[j + 16] << 4));
}

// IQ4_NL: one fp16 scale per 32 values; layout d, qs[16]
KT_QUANT_CLONES void q_iq4_nl(const float* x, uint8_t* out) {
  const uint16_t dh = to_half(search_scale_nl(x));
  std::memcpy(out, &dh, 2);
  pack_codes_nl(x, from_half(dh), out + 2);
}

// IQ4_XS: 8 sub-blocks of 32 with 6-bit signed scales of one fp16 scale; layout d, scales_h,
// scales_l[4], qs[128]
KT_QUANT_CLONES void q_iq4_xs(const float* x, uint8_t* out) {
  float scales[8], max_scale = 0, amax = 0;
  for (int ib = 0; ib < 8; ++ib) {
    scales[ib] = search_scale_nl(x + 32 * ib);
    if (std::fabs(scales[ib]) > amax) { amax = std::fabs(scales[ib]); max_scale = scales[ib]; }
  }
  std::memset(out, 0, 136);
  if (amax < GROUP_EPS) {  // all-zero block: codes of 0 under a zero scale
    for (int j = 0; j < 128; ++j) out[8 + j] = static_cast<uint8_t>(8 | (8 << 4));
    return;
  }
  // the largest scale lands on -32, the far end of the signed 6-bit range
  const uint16_t dh = to_half(-max_scale / 32.f);
  const float d = from_half(dh), id = d != 0.f ? 1.f / d : 0.f;
  uint16_t scales_h = 0;
  uint8_t* scales_l = out + 4;
  for (int ib = 0; ib < 8; ++ib) {
    const int l = std::clamp(nearest(id * scales[ib]), -32, 31);
    scales_l[ib / 2] |= static_cast<uint8_t>(((l + 32) & 0xF) << (4 * (ib % 2)));
    scales_h |= static_cast<uint16_t>(((l + 32) >> 4) << (2 * ib));
    pack_codes_nl(x + 32 * ib, d * l, out + 8 + 16 * ib);
  }
  std::memcpy(out, &dh, 2);
  std::memcpy(out + 2, &scales_h, 2);
}

void q_q4_K(const float* x, uint8_t* out) { block_q45(x, out, false); }
void q_q5_K(const float* x, uint8_t* out) { block_q45(x, out, true); }

using BlockQuantizer = void (*)(const float*, uint8_t*);
constexpr BlockQuantizer q_none = nullptr;

// the block quantizer of a type, from its KT_GGML_TYPES row (ggml_types.h); null: none here
BlockQuantizer quantizer(int type) {
  switch (type) {
#define KT_Q_CASE(name, id, elems, bytes, supported, dq, q) \
  case GGML_##name:                                        \
    return q_##q;
    KT_GGML_TYPES(KT_Q_CASE)
#undef KT_Q_CASE
    default: return nullptr;
  }
}

}  // namespace

bool quantize_rows_supported(int ggml_type) { return quantizer(ggml_type) != nullptr; }

void quantize_rows(int type, const float* src, void* dst, int64_t nrows, int64_t n_per_row, int n_threads) {
  const BlockQuantizer q = quantizer(type);
  if (!q) throw std::invalid_argument("quantize_rows: ggml type " + std::to_string(type) + " is not supported");
  const int be = type_info(type).block_elems, bb = type_info(type).block_bytes;
  if (n_per_row <= 0 || n_per_row % be)
    throw std::invalid_argument("quantize_rows: rows must be a multiple of " + std::to_string(be));
  const int64_t blocks = nrows * (n_per_row / be);
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* x = src + b * be;
      q(x, static_cast<uint8_t*>(dst) + b * bb);
    }
  };
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_threads, blocks * be / (16 * QK))));
  if (nt <= 1) {
    run(0, blocks);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (blocks + nt - 1) / nt;
  for (int t = 0; t < nt; ++t) {
    const int64_t b0 = t * per, b1 = std::min(blocks, b0 + per);
    if (b0 < b1) pool.emplace_back(run, b0, b1);
  }
  for (auto& th : pool) th.join();
}

}  // namespace kt
