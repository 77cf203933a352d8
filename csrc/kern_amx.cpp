// AMX tile kernels for the packed int8 / bf16 layouts (compiled with -mamx-tile -mamx-int8
// -mamx-bf16 + AVX-512 flags).  Installed by dispatch.cpp only when active_tier() == AMX, which
// requires CPUID AMX bits and the Linux XTILEDATA permission (cpu_features.cpp).
//
// The AMX tier keeps the avx512bf16 tier's activation formats (U8_G128 for int8, F32 for bf16)
// and packed layouts, so a call with few tokens goes to that tier's VNNI-512 kernel (a tile of
// one token wastes most of a tdp*, and decode is bound by the weight read either way) and a
// call with more takes the tiles here.  Blocking: 2 token tiles (A, 16 tokens each) x 2 panel
// tiles (B, 16 rows each) -> 4 accumulator tiles; each B tile is loaded once per 32 tokens.
//   Int8: per 128-k group, 2 tdpbusd(u8 act, s8 w) per accumulator; the int32 tile is stored,
//         the -128 * row-sum correction added and scaled by the token's group scale into fp32.
//   BF16: activations are rounded to bf16 while they are gathered; tdpbf16ps over the whole K.
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "kernels.h"

namespace kt {
namespace {

// Tokens from which a call runs on tiles (fewer: the VNNI-512 kernel); bench/linear.py and
// bench/moe_layer.py print both sides of this switch.
constexpr int kAmxMinTokens = 2;

GemmFn g_i8_vnni = nullptr;    // avx512bf16 tier's kernels for the same layouts
GemmFn g_bf16_vnni = nullptr;

struct alignas(64) TileCfg {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile loads, stores and the config load as asm with real memory operands: GCC 12's intrinsics
// declare no memory access for tileloadd/tilestored and only 8 bytes for ldtilecfg, so the
// compiler may drop or reorder the stores that fill a tile config or a gathered A buffer.
inline void tile_loadconfig(const TileCfg& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c) : "memory"); }
#define KT_TILE_LOADD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define KT_TILE_STORED(t, base, stride) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")

// tmm0/1: A (m0 / m1 tokens x 64 bytes); tmm2/3: B (16 x 64 bytes); tmm4..7: C[a][b] (tmm 4 + 2a + b).
void config_tiles(int m0, int m1) {
  TileCfg c;
  std::memset(&c, 0, sizeof(c));
  c.palette_id = 1;
  const int m[2] = {m0, m1};
  for (int a = 0; a < 2; ++a) {
    if (!m[a]) continue;
    c.rows[a] = static_cast<uint8_t>(m[a]);
    c.colsb[a] = 64;
    for (int b = 0; b < 2; ++b) {
      c.rows[4 + 2 * a + b] = static_cast<uint8_t>(m[a]);
      c.colsb[4 + 2 * a + b] = 64;
    }
  }
  for (int b = 2; b < 4; ++b) {
    c.rows[b] = 16;
    c.colsb[b] = 64;
  }
  tile_loadconfig(c);
}

// The 2x2 block's accumulators: zero them; one k step (A tiles from a0 / a1 with row stride lda,
// B tiles b0 / b1 of 16 x 64 bytes; tdpbf16ps or tdpbusd); store accumulator i (C[i / 2][i % 2]).
inline void zero_2x2(bool two_a, bool two_b) {
  _tile_zero(4);
  if (two_b) _tile_zero(5);
  if (two_a) _tile_zero(6);
  if (two_a && two_b) _tile_zero(7);
}

template <bool BF16>
inline void step_2x2(bool two_a, bool two_b, const void* a0, const void* a1, size_t lda, const void* b0, const void* b1) {
#define KT_DP(c, a, b)                      \
  do {                                      \
    if constexpr (BF16) _tile_dpbf16ps(c, a, b); \
    else _tile_dpbusd(c, a, b);             \
  } while (0)
  KT_TILE_LOADD(2, b0, 64);
  KT_TILE_LOADD(0, a0, lda);
  KT_DP(4, 0, 2);
  if (two_b) {
    KT_TILE_LOADD(3, b1, 64);
    KT_DP(5, 0, 3);
  }
  if (two_a) {
    KT_TILE_LOADD(1, a1, lda);
    KT_DP(6, 1, 2);
    if (two_b) KT_DP(7, 1, 3);
  }
#undef KT_DP
}

inline void store_acc(int i, void* buf) {
  switch (i) {
    case 0: KT_TILE_STORED(4, buf, 64); break;
    case 1: KT_TILE_STORED(5, buf, 64); break;
    case 2: KT_TILE_STORED(6, buf, 64); break;
    default: KT_TILE_STORED(7, buf, 64); break;
  }
}

// Per-thread scratch of the tile kernels (gathered activation rows, repacked weight rows).
uint8_t* scratch(size_t bytes) {
  struct Buf {
    uint8_t* p = nullptr;
    size_t cap = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf buf;
  if (bytes > buf.cap) {
    std::free(buf.p);
    buf.cap = (bytes + 63) & ~size_t(63);
    buf.p = static_cast<uint8_t*>(std::aligned_alloc(64, buf.cap));
    if (!buf.p) throw std::bad_alloc();
  }
  return buf.p;
}

inline int kmin(int a, int b) { return a < b ? a : b; }
inline int kmax(int a, int b) { return a > b ? a : b; }
#include "tiles.inc"

// Prefetch (into L2) the next panel pair of this matrix, spread over `steps` k steps: the tiles
// stream the weights from DRAM once per token block, like decode.
inline Prefetcher next_panels(const GemmArgs& g, int p, size_t panel_bytes, int steps) {
  const int avail = (kmax(g.nr, g.nr_avail) + kPanelRows - 1) / kPanelRows;
  const int n = kmin(2, avail - (p + 2));
  if (n <= 0) return Prefetcher(nullptr, 0, 0);
  return Prefetcher(g.W + static_cast<size_t>(p + 2) * panel_bytes, n * panel_bytes, steps, true);
}

// Scale the stored int32 tile C[a][b] (m tokens x 16 rows) into acc[a*16 + t][b].
inline void accum_i8(const int32_t* cbuf, int m, const int32_t* corr, const float* const* ad, int grp,
                     __m512* acc) {
  const __m512i c = _mm512_loadu_si512(corr);
  for (int t = 0; t < m; ++t) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_load_si512(cbuf + 16 * t), c));
    acc[2 * t] = _mm512_fmadd_ps(v, _mm512_set1_ps(ad[t][grp]), acc[2 * t]);
  }
}

void i8_block(const GemmArgs& g, const uint8_t* abuf, const float* const* ad, int m0, int m1, int p, bool two_b,
              __m512 (*acc)[2]) {
  const int Kpad = g.Kpad, ng = Kpad / kI8Group;
  const bool two_a = m1 > 0;
  const size_t panel_bytes = static_cast<size_t>(kPanelRows) * Kpad;
  const uint8_t* P0 = g.W + p * panel_bytes;
  const uint8_t* P1 = P0 + panel_bytes;
  const int32_t* cr0 = g.w_corr + static_cast<size_t>(p) * ng * kPanelRows;
  const int32_t* cr1 = cr0 + ng * kPanelRows;
  const uint8_t* a0 = abuf;
  const uint8_t* a1 = abuf + static_cast<size_t>(16) * Kpad;
  alignas(64) int32_t cbuf[4][16 * 16];
  const Prefetcher pref = next_panels(g, p, panel_bytes, Kpad / 64);
  for (int grp = 0; grp < ng; ++grp) {
    zero_2x2(two_a, two_b);
    for (int c = 0; c < kI8Group / 64; ++c) {
      const size_t k0 = static_cast<size_t>(grp) * kI8Group + 64 * c;
      pref.at(static_cast<int>(k0 / 64));
      step_2x2<false>(two_a, two_b, a0 + k0, a1 + k0, Kpad, P0 + k0 * 16, P1 + k0 * 16);
    }
    for (int i = 0; i < 4; ++i) {
      const int a = i / 2, b = i % 2;
      if ((a && !two_a) || (b && !two_b)) continue;
      store_acc(i, cbuf[i]);
      accum_i8(cbuf[i], a ? m1 : m0, (b ? cr1 : cr0) + grp * kPanelRows, ad + 16 * a, grp, &acc[16 * a][b]);
    }
  }
}

// acc[t][b] (panel p + b, token t0 + t) times the row scales -> C.
inline void store_out(const GemmArgs& g, int t0, int m, int p, int nb, const __m512 (*acc)[2], bool scale) {
  for (int b = 0; b < nb; ++b) {
    const int r0 = (p + b) * kPanelRows;
    if (r0 >= g.nr) break;
    const int nrow = kmin(16, g.nr - r0);
    const __mmask16 mk = static_cast<__mmask16>((1u << nrow) - 1);
    const __m512 ws = scale ? _mm512_maskz_loadu_ps(mk, g.w_scale + r0) : _mm512_set1_ps(1.f);
    for (int t = 0; t < m; ++t)
      _mm512_mask_storeu_ps(g.C + static_cast<size_t>(t0 + t) * g.ldc + r0, mk, _mm512_mul_ps(acc[t][b], ws));
  }
}

void gemm_i8_amx(const GemmArgs& g) {
  if (g.nt < kAmxMinTokens) return g_i8_vnni(g);
  const int np = (g.nr + kPanelRows - 1) / kPanelRows;
  const int Kpad = g.Kpad;
  uint8_t* abuf = scratch(static_cast<size_t>(32) * Kpad);
  for (int t0 = 0; t0 < g.nt; t0 += 32) {
    const int m = kmin(32, g.nt - t0), m0 = kmin(16, m), m1 = m - m0;
    const float* ad[32];
    for (int t = 0; t < m; ++t) {
      std::memcpy(abuf + static_cast<size_t>(t) * Kpad, g.A[t0 + t], Kpad);
      ad[t] = reinterpret_cast<const float*>(g.A[t0 + t] + Kpad);
    }
    config_tiles(m0, m1);
    for (int p = 0; p < np; p += 2) {
      const bool two_b = p + 1 < np;
      __m512 acc[32][2];
      for (int t = 0; t < m; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
      i8_block(g, abuf, ad, m0, m1, p, two_b, acc);
      store_out(g, t0, m, p, two_b ? 2 : 1, acc, true);
    }
  }
  _tile_release();
}

void bf16_block(const GemmArgs& g, const uint8_t* abuf, int m0, int m1, int p, bool two_b, __m512 (*acc)[2]) {
  const int Kpad = g.Kpad;
  const bool two_a = m1 > 0;
  const size_t panel_bytes = static_cast<size_t>(kPanelRows) * Kpad * 2, lda = 2 * static_cast<size_t>(Kpad);
  const uint8_t* P0 = g.W + p * panel_bytes;
  const uint8_t* P1 = P0 + panel_bytes;
  const uint8_t* a0 = abuf;
  const uint8_t* a1 = abuf + 16 * lda;
  zero_2x2(two_a, two_b);
  const Prefetcher pref = next_panels(g, p, panel_bytes, Kpad / 32);
  for (int k0 = 0; k0 < Kpad; k0 += 32) {  // 32 bf16 = 64 bytes per tile row
    const size_t off = static_cast<size_t>(k0) * 2;
    pref.at(k0 / 32);
    step_2x2<true>(two_a, two_b, a0 + off, a1 + off, lda, P0 + off * 16, P1 + off * 16);
  }
  alignas(64) float cbuf[16 * 16];
  for (int i = 0; i < 4; ++i) {
    const int a = i / 2, b = i % 2;
    if ((a && !two_a) || (b && !two_b)) continue;
    store_acc(i, cbuf);
    for (int t = 0; t < (a ? m1 : m0); ++t) acc[16 * a + t][b] = _mm512_load_ps(cbuf + 16 * t);
  }
}

void gemm_bf16_amx(const GemmArgs& g) {
  if (g.nt < kAmxMinTokens) return g_bf16_vnni(g);
  const int np = (g.nr + kPanelRows - 1) / kPanelRows;
  const int Kpad = g.Kpad;
  const size_t lda = 2 * static_cast<size_t>(Kpad);
  uint8_t* abuf = scratch(32 * lda);
  for (int t0 = 0; t0 < g.nt; t0 += 32) {
    const int m = kmin(32, g.nt - t0), m0 = kmin(16, m), m1 = m - m0;
    for (int t = 0; t < m; ++t) {  // F32 activation rows (zero padded to Kpad) -> bf16
      const float* x = reinterpret_cast<const float*>(g.A[t0 + t]);
      uint16_t* y = reinterpret_cast<uint16_t*>(abuf + t * lda);
      for (int k = 0; k < Kpad; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
        _mm512_storeu_si512(y + k, reinterpret_cast<const __m512i&>(v));
      }
    }
    config_tiles(m0, m1);
    for (int p = 0; p < np; p += 2) {
      const bool two_b = p + 1 < np;
      __m512 acc[32][2];
      bf16_block(g, abuf, m0, m1, p, two_b, acc);
      store_out(g, t0, m, p, two_b ? 2 : 1, acc, false);
    }
  }
  _tile_release();
}


// ---------------------------------------------------------------------------------------------
// Llamafile types, prefill: the weight rows of a call are dequantised once (the tier's
// dequant_row) and rounded to bf16, row-major, so they load straight into A tiles; the
// activations, decoded from their int8 / bf16 rows, are laid out once per call as bf16 B tiles
// (k pairs x 16 tokens).  C tiles hold 16 rows x 16 tokens and are transposed on the way out.
// Worth it once a call has enough tokens to amortise the dequantisation, which costs per weight
// what the type's dequant_row costs: the per-type minimum below is where bench/linear.py
// measured the tiles faster than the tier's integer kernels (2048x2048, 2 threads); types not
// listed (the 32-element block types' panel kernels, IQ4_XS, most IQ grid types) stay on those.
// ---------------------------------------------------------------------------------------------
constexpr std::pair<int, int> kAmxLfMinTokens[] = {
    {GGML_BF16, 32}, {GGML_Q4_K, 64}, {GGML_Q5_K, 64}, {GGML_Q2_K, 64}, {GGML_Q3_K, 128},
    {GGML_Q6_K, 128}, {GGML_Q8_0, 256}, {GGML_IQ2_XXS, 256},
};

GemmFn g_lf_base[kMaxGgmlType] = {};
int g_lf_min[kMaxGgmlType] = {};
ActFmt g_lf_act[kMaxGgmlType] = {};
void (*g_dequant_row)(int, const void*, float*, int64_t) = nullptr;

// 16x16 32-bit transpose of r[0..15] in place.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i, i+4, i+8, i+12 hold lane blocks
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

inline void store_bf16(uint16_t* y, __m512 lo, __m512 hi) {  // 32 floats -> 32 bf16
  const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
  _mm512_storeu_si512(y, reinterpret_cast<const __m512i&>(v));
}

// One activation row (format f, K elements, natural order out) -> bf16 y[K].
void act_row_bf16(ActFmt f, const uint8_t* row, int K, uint16_t* y) {
  if (f == ActFmt::BF16) {
    std::memcpy(y, row, 2 * static_cast<size_t>(K));
    return;
  }
  const int8_t* qs = reinterpret_cast<const int8_t*>(row);
  const float* d = reinterpret_cast<const float*>(row + K);
  for (int k = 0; k < K; k += 32) {
    // Q8_256 on this tier: each 128 stores its 32-element sub-blocks as 0, 2, 1, 3
    int src = k;
    if (f == ActFmt::Q8_256) {
      const int j = (k / 32) & 3;
      src = (k & ~127) + 32 * (j == 1 ? 2 : j == 2 ? 1 : j);
    }
    const __m512 s = _mm512_set1_ps(f == ActFmt::Q8_32 ? d[k / 32] : d[k / 256]);
    const __m128i* q = reinterpret_cast<const __m128i*>(qs + src);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), s);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), s);
    store_bf16(y + k, lo, hi);
  }
}

void gemm_lf_amx(const GemmArgs& g, int type) {
  const int K = g.K;
  const ActFmt af = g_lf_act[type];
  const int ntb = (g.nt + 15) / 16;  // token blocks of 16 (zero padded)
  const size_t kp = K / 2;           // u32 units (bf16 pairs) per row
  const size_t bblk = kp * 16 * 4;   // bytes of one token block's B layout
  const size_t rows_bytes = 2 * 16 * static_cast<size_t>(K) * 2;  // 2 row tiles x 16 rows, bf16
  uint8_t* base = scratch(ntb * bblk + rows_bytes + 16 * static_cast<size_t>(K) * 2 + 4 * static_cast<size_t>(K));
  uint8_t* B = base;                                    // [ntb][K/2][16] u32
  uint16_t* Aw = reinterpret_cast<uint16_t*>(base + ntb * bblk);  // [32][K] bf16 weight rows
  uint16_t* arow = Aw + 32 * static_cast<size_t>(K);    // [16][K] bf16 activation rows
  float* frow = reinterpret_cast<float*>(arow + 16 * static_cast<size_t>(K));  // [K] fp32
  // activations -> B tiles
  for (int tb = 0; tb < ntb; ++tb) {
    for (int t = 0; t < 16; ++t) {
      const int tt = 16 * tb + t;
      if (tt < g.nt) act_row_bf16(af, g.A[tt], K, arow + t * static_cast<size_t>(K));
      else std::memset(arow + t * static_cast<size_t>(K), 0, 2 * static_cast<size_t>(K));
    }
    uint32_t* Bt = reinterpret_cast<uint32_t*>(B + tb * bblk);
    const uint32_t* a32 = reinterpret_cast<const uint32_t*>(arow);
    for (size_t u = 0; u < kp; u += 16) {  // K % 32 == 0: whole 16-unit columns
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(a32 + t * kp + u);
      transpose16(r);  // r[i] = unit u + i of tokens 0..15
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(Bt + (u + i) * 16, r[i]);
    }
  }
  TileCfg c;
  std::memset(&c, 0, sizeof(c));
  c.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  tile_loadconfig(c);
  const size_t lda = 2 * static_cast<size_t>(K);
  alignas(64) float cbuf[16 * 16];
  for (int r0 = 0; r0 < g.nr; r0 += 32) {
    const int nrows = kmin(32, g.nr - r0);
    for (int r = 0; r < 32; ++r) {
      uint16_t* y = Aw + r * static_cast<size_t>(K);
      if (r >= nrows) {
        std::memset(y, 0, lda);
        continue;
      }
      g_dequant_row(type, g.W + static_cast<size_t>(r0 + r) * g.w_row_bytes, frow, K);
      for (int k = 0; k < K; k += 32) store_bf16(y + k, _mm512_loadu_ps(frow + k), _mm512_loadu_ps(frow + k + 16));
    }
    const bool two_a = nrows > 16;
    for (int tb = 0; tb < ntb; tb += 2) {
      const bool two_b = tb + 1 < ntb;
      const uint8_t* B0 = B + tb * bblk;
      const uint8_t* B1 = B0 + bblk;
      zero_2x2(two_a, two_b);
      for (int k0 = 0; k0 < K; k0 += 32) {
        const size_t boff = static_cast<size_t>(k0 / 2) * 64;
        step_2x2<true>(two_a, two_b, Aw + k0, Aw + 16 * static_cast<size_t>(K) + k0, lda, B0 + boff, B1 + boff);
      }
      for (int i = 0; i < 4; ++i) {
        const int a = i / 2, b = i % 2;
        if ((a && !two_a) || (b && !two_b)) continue;
        store_acc(i, cbuf);
        __m512i v[16];  // cbuf[row][token] -> v[token][row]
        for (int r = 0; r < 16; ++r) v[r] = _mm512_load_si512(cbuf + 16 * r);
        transpose16(v);
        const int rr = r0 + 16 * a, nr = kmin(16, g.nr - rr);
        if (nr <= 0) continue;
        const __mmask16 mk = static_cast<__mmask16>((1u << nr) - 1);
        const int t0 = 16 * (tb + b);
        for (int t = 0; t < 16 && t0 + t < g.nt; ++t)
          _mm512_mask_storeu_ps(g.C + static_cast<size_t>(t0 + t) * g.ldc + rr, mk, _mm512_castsi512_ps(v[t]));
      }
    }
  }
  _tile_release();
}

// ---------------------------------------------------------------------------------------------
// Q8_0 with 2..16 tokens (batched decode, short chunks) on int8 tiles, straight from the blocks:
// per 32-k block, A = 16 weight rows x 32 signed bytes loaded in place (row stride = the row's
// bytes, the 2-byte scale skipped by the start address), B = the block's activations of all
// tokens (8 x 4*nt bytes, laid out once per call), tdpbssd -> C = 16 rows x nt int32, stored
// contiguously, so nt zmm hold (row, token) pairs row-major and take the block's scale
// dw[row] * da[token] through two fixed lane permutations.  Against the VNNI-512 row tiles this
// drops the per-(row, token) dot and its horizontal layout (4 ops per 64 weights and token) to
// one tile op per 16 rows plus 4 ops per 16 (row, token) pairs: at 4 tokens the 262k-row Q8_0
// lm_head was compute-bound on the row tiles, here it streams (2 threads: T=2 and 4 as fast as
// T=1).  From 5 tokens the VNNI-512 panels win (8 tokens: 8.0 ms against 8.6, 16: ~9 against
// 13): the tile stores and the per-pair scaling grow with the tokens, the panels' unpack does not.
// ---------------------------------------------------------------------------------------------
constexpr int kQ8TileMaxTokens = 4;

void gemm_q8_0_amx(const GemmArgs& g) {
  const int K = g.K, nt = g.nt, nb = K / 32;
  const size_t rb = g.w_row_bytes;
  // scratch: B tiles [nb][8 rows][64 bytes], token-scale patterns [nb][nt][16] floats,
  // lane index vectors, a zero-padded copy of a partial last row group
  const size_t b_bytes = static_cast<size_t>(nb) * 8 * 64;
  const size_t s_bytes = static_cast<size_t>(nb) * nt * 64;
  uint8_t* base = scratch(b_bytes + s_bytes + 16 * rb + 64);
  uint8_t* B = base;
  float* daP = reinterpret_cast<float*>(base + b_bytes);
  uint8_t* tail = base + b_bytes + s_bytes;
  __m512i ridx[kQ8TileMaxTokens], tidx[kQ8TileMaxTokens];  // lane l of zmm j: row (16j + l) / nt, token (16j + l) % nt
  for (int j = 0; j < nt; ++j) {
    alignas(64) int32_t ri[16], ti[16];
    for (int l = 0; l < 16; ++l) {
      ri[l] = (16 * j + l) / nt;
      ti[l] = (16 * j + l) % nt;
    }
    ridx[j] = _mm512_load_si512(ri);
    tidx[j] = _mm512_load_si512(ti);
  }
  for (int b = 0; b < nb; ++b) {
    uint32_t* Bb = reinterpret_cast<uint32_t*>(B + static_cast<size_t>(b) * 512);
    alignas(64) float da[16] = {};
    for (int t = 0; t < nt; ++t) {
      const uint8_t* q = g.A[t] + 32 * static_cast<size_t>(b);
      for (int k4 = 0; k4 < 8; ++k4) std::memcpy(Bb + 16 * k4 + t, q + 4 * k4, 4);
      da[t] = reinterpret_cast<const float*>(g.A[t] + K)[b];
    }
    const __m512 dav = _mm512_load_ps(da);
    for (int j = 0; j < nt; ++j)
      _mm512_storeu_ps(daP + (static_cast<size_t>(b) * nt + j) * 16, _mm512_permutexvar_ps(tidx[j], dav));
  }
  TileCfg c;
  std::memset(&c, 0, sizeof(c));
  c.palette_id = 1;
  for (int i = 0; i < 2; ++i) {
    c.rows[i] = 16;  // A: 16 rows x 32 bytes
    c.colsb[i] = 32;
    c.rows[2 + i] = 8;  // B: 8 x (nt tokens x 4 bytes)
    c.colsb[2 + i] = static_cast<uint16_t>(4 * nt);
    c.rows[4 + i] = 16;  // C: 16 rows x nt int32
    c.colsb[4 + i] = static_cast<uint16_t>(4 * nt);
  }
  tile_loadconfig(c);
  const __m512i roff = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(rb)));
  alignas(64) int32_t cbuf[2][16 * kQ8TileMaxTokens];
  alignas(64) float obuf[16 * kQ8TileMaxTokens];
  for (int r0 = 0; r0 < g.nr; r0 += 16) {
    const int nrows = kmin(16, g.nr - r0);
    const uint8_t* W = g.W + static_cast<size_t>(r0) * rb;
    if (nrows < 16) {  // tiles load 16 rows: the last partial group from a zero-padded copy
      std::memcpy(tail, W, nrows * rb);
      std::memset(tail + nrows * rb, 0, (16 - nrows) * rb);
      W = tail;
    }
    // the group after next into L2 while this one is computed (rows are contiguous)
    const int pf_row = r0 + 32;
    const int pf_rows = kmin(16, g.nr_avail - pf_row);
    const Prefetcher pref(pf_rows > 0 ? g.W + static_cast<size_t>(pf_row) * rb : nullptr,
                          pf_rows > 0 ? pf_rows * rb : 0, (nb + 1) / 2, true);
    __m512 acc[kQ8TileMaxTokens];
    for (int j = 0; j < nt; ++j) acc[j] = _mm512_setzero_ps();
    auto scale_add = [&](const int32_t* cb, int b) {
      const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
          _mm512_i32gather_epi32(roff, W + 34 * static_cast<size_t>(b), 1)));  // the 16 rows' fp16 d
      const float* dp = daP + static_cast<size_t>(b) * nt * 16;
      for (int j = 0; j < nt; ++j) {
        const __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(ridx[j], dw), _mm512_loadu_ps(dp + 16 * j));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * j)), sc, acc[j]);
      }
    };
    int b = 0;
    for (; b + 1 < nb; b += 2) {  // two blocks in flight: C of one is stored while the other computes
      pref.at(b / 2);
      const uint8_t* a0 = W + 34 * static_cast<size_t>(b) + 2;
      KT_TILE_LOADD(2, B + static_cast<size_t>(b) * 512, 64);
      KT_TILE_LOADD(0, a0, rb);
      _tile_zero(4);
      _tile_dpbssd(4, 0, 2);
      KT_TILE_LOADD(3, B + static_cast<size_t>(b + 1) * 512, 64);
      KT_TILE_LOADD(1, a0 + 34, rb);
      _tile_zero(5);
      _tile_dpbssd(5, 1, 3);
      KT_TILE_STORED(4, cbuf[0], 4 * nt);
      KT_TILE_STORED(5, cbuf[1], 4 * nt);
      scale_add(cbuf[0], b);
      scale_add(cbuf[1], b + 1);
    }
    if (b < nb) {
      KT_TILE_LOADD(2, B + static_cast<size_t>(b) * 512, 64);
      KT_TILE_LOADD(0, W + 34 * static_cast<size_t>(b) + 2, rb);
      _tile_zero(4);
      _tile_dpbssd(4, 0, 2);
      KT_TILE_STORED(4, cbuf[0], 4 * nt);
      scale_add(cbuf[0], b);
    }
    for (int j = 0; j < nt; ++j) _mm512_store_ps(obuf + 16 * j, acc[j]);
    for (int t = 0; t < nt; ++t) {
      float* y = g.C + static_cast<size_t>(t) * g.ldc + r0;
      for (int r = 0; r < nrows; ++r) y[r] = obuf[r * nt + t];
    }
  }
  _tile_release();
}

template <int T>
void lf_amx(const GemmArgs& g) {
  if constexpr (T == GGML_Q8_0)
    if (g.nt >= 2 && g.nt <= kQ8TileMaxTokens) return gemm_q8_0_amx(g);
  if (g.nt < g_lf_min[T] || g.K % 32) return g_lf_base[T](g);  // tiles take 32 k at a time
  gemm_lf_amx(g, T);
}
template <int... T>
constexpr std::array<GemmFn, sizeof...(T)> lf_amx_table(std::integer_sequence<int, T...>) {
  return {lf_amx<T>...};
}

}  // namespace

GemmFn amx_gemm_i8(GemmFn vnni) {
  g_i8_vnni = vnni;
  return gemm_i8_amx;
}
GemmFn amx_gemm_bf16(GemmFn vnni) {
  g_bf16_vnni = vnni;
  return gemm_bf16_amx;
}

void amx_llamafile_prefill(KernelTable& t) {
  static constexpr auto wrappers = lf_amx_table(std::make_integer_sequence<int, kMaxGgmlType>());
  static std::string names[kMaxGgmlType];
  g_dequant_row = t.dequant_row;
  for (const auto& [ty, min_tokens] : kAmxLfMinTokens) {
    const ActFmt f = t.lf_act[ty];
    if (!t.lf_gemm[ty] || (f != ActFmt::Q8_32 && f != ActFmt::Q8_256 && f != ActFmt::BF16)) continue;
    g_lf_min[ty] = min_tokens;
    g_lf_base[ty] = t.lf_gemm[ty];
    g_lf_act[ty] = f;
    t.lf_gemm[ty] = wrappers[ty];
    names[ty] = std::string(ty == GGML_Q8_0 ? "amx_i8_q8_0 (T<=4), " : "") + "amx_bf16_dq (T>=" +
                std::to_string(min_tokens) + "; else " + t.lf_prefill[ty] + ")";
    t.lf_prefill[ty] = names[ty].c_str();
  }
}

}  // namespace kt
