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

#include <cstdint>
#include <cstring>
#include <memory>

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

// Per-thread buffer for the gathered activation rows of one 32-token block.
uint8_t* scratch(size_t bytes) {
  thread_local std::unique_ptr<uint8_t[]> buf;
  thread_local size_t cap = 0;
  if (bytes > cap) {
    buf.reset(new (std::align_val_t(64)) uint8_t[bytes]);
    cap = bytes;
  }
  return buf.get();
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

template <bool TWO_A, bool TWO_B>
void i8_block(const GemmArgs& g, const uint8_t* abuf, const float* const* ad, int m0, int m1, int p,
              __m512 (*acc)[2]) {
  const int Kpad = g.Kpad, ng = Kpad / kI8Group;
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
    _tile_zero(4);
    if (TWO_B) _tile_zero(5);
    if (TWO_A) _tile_zero(6);
    if (TWO_A && TWO_B) _tile_zero(7);
    for (int c = 0; c < kI8Group / 64; ++c) {
      const size_t k0 = static_cast<size_t>(grp) * kI8Group + 64 * c;
      pref.at(static_cast<int>(k0 / 64));
      KT_TILE_LOADD(2, P0 + k0 * 16, 64);
      KT_TILE_LOADD(0, a0 + k0, Kpad);
      _tile_dpbusd(4, 0, 2);
      if (TWO_B) {
        KT_TILE_LOADD(3, P1 + k0 * 16, 64);
        _tile_dpbusd(5, 0, 3);
      }
      if (TWO_A) {
        KT_TILE_LOADD(1, a1 + k0, Kpad);
        _tile_dpbusd(6, 1, 2);
        if (TWO_B) _tile_dpbusd(7, 1, 3);
      }
    }
    KT_TILE_STORED(4, cbuf[0], 64);
    if (TWO_B) KT_TILE_STORED(5, cbuf[1], 64);
    if (TWO_A) KT_TILE_STORED(6, cbuf[2], 64);
    if (TWO_A && TWO_B) KT_TILE_STORED(7, cbuf[3], 64);
    accum_i8(cbuf[0], m0, cr0 + grp * kPanelRows, ad, grp, &acc[0][0]);
    if (TWO_B) accum_i8(cbuf[1], m0, cr1 + grp * kPanelRows, ad, grp, &acc[0][1]);
    if (TWO_A) accum_i8(cbuf[2], m1, cr0 + grp * kPanelRows, ad + 16, grp, &acc[16][0]);
    if (TWO_A && TWO_B) accum_i8(cbuf[3], m1, cr1 + grp * kPanelRows, ad + 16, grp, &acc[16][1]);
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
      if (m1) {
        if (two_b) i8_block<true, true>(g, abuf, ad, m0, m1, p, acc);
        else i8_block<true, false>(g, abuf, ad, m0, m1, p, acc);
      } else {
        if (two_b) i8_block<false, true>(g, abuf, ad, m0, m1, p, acc);
        else i8_block<false, false>(g, abuf, ad, m0, m1, p, acc);
      }
      store_out(g, t0, m, p, two_b ? 2 : 1, acc, true);
    }
  }
  _tile_release();
}

template <bool TWO_A, bool TWO_B>
void bf16_block(const GemmArgs& g, const uint8_t* abuf, int m0, int m1, int p, __m512 (*acc)[2]) {
  const int Kpad = g.Kpad;
  const size_t panel_bytes = static_cast<size_t>(kPanelRows) * Kpad * 2, lda = 2 * static_cast<size_t>(Kpad);
  const uint8_t* P0 = g.W + p * panel_bytes;
  const uint8_t* P1 = P0 + panel_bytes;
  const uint8_t* a0 = abuf;
  const uint8_t* a1 = abuf + 16 * lda;
  _tile_zero(4);
  if (TWO_B) _tile_zero(5);
  if (TWO_A) _tile_zero(6);
  if (TWO_A && TWO_B) _tile_zero(7);
  const Prefetcher pref = next_panels(g, p, panel_bytes, Kpad / 32);
  for (int k0 = 0; k0 < Kpad; k0 += 32) {  // 32 bf16 = 64 bytes per tile row
    const size_t off = static_cast<size_t>(k0) * 2;
    pref.at(k0 / 32);
    KT_TILE_LOADD(2, P0 + off * 16, 64);
    KT_TILE_LOADD(0, a0 + off, lda);
    _tile_dpbf16ps(4, 0, 2);
    if (TWO_B) {
      KT_TILE_LOADD(3, P1 + off * 16, 64);
      _tile_dpbf16ps(5, 0, 3);
    }
    if (TWO_A) {
      KT_TILE_LOADD(1, a1 + off, lda);
      _tile_dpbf16ps(6, 1, 2);
      if (TWO_B) _tile_dpbf16ps(7, 1, 3);
    }
  }
  alignas(64) float cbuf[16 * 16];
  const int tiles = (TWO_A ? 2 : 1) * 2;
  for (int i = 0; i < tiles; ++i) {
    const int a = i / 2, b = i % 2;
    if (b && !TWO_B) continue;
    switch (i) {
      case 0: KT_TILE_STORED(4, cbuf, 64); break;
      case 1: KT_TILE_STORED(5, cbuf, 64); break;
      case 2: KT_TILE_STORED(6, cbuf, 64); break;
      default: KT_TILE_STORED(7, cbuf, 64); break;
    }
    const int m = a ? m1 : m0;
    for (int t = 0; t < m; ++t) acc[16 * a + t][b] = _mm512_load_ps(cbuf + 16 * t);
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
      if (m1) {
        if (two_b) bf16_block<true, true>(g, abuf, m0, m1, p, acc);
        else bf16_block<true, false>(g, abuf, m0, m1, p, acc);
      } else {
        if (two_b) bf16_block<false, true>(g, abuf, m0, m1, p, acc);
        else bf16_block<false, false>(g, abuf, m0, m1, p, acc);
      }
      store_out(g, t0, m, p, two_b ? 2 : 1, acc, false);
    }
  }
  _tile_release();
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

}  // namespace kt
