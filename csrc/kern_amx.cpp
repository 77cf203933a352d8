// AMX tile kernels for the packed int8 / bf16 layouts (compiled with -mamx-tile -mamx-int8
// -mamx-bf16 + AVX-512 flags).  Installed by dispatch.cpp only when active_tier() == AMX, which
// requires CPUID AMX bits and the Linux XTILEDATA permission (cpu_features.cpp).
//
// Int8: A tile = up to 16 tokens x 64 k (s8 activations, I8_G128 rows), B tile = one 16-row
// panel slice (16 k-quads x 64 bytes, contiguous), tdpbssd; every 128-k group the int32 tile is
// scaled by the per-token group scale.  BF16: tdpbf16ps over the whole K.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace kt {
namespace {

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

void config_tiles(int m) {
  TileCfg c;
  std::memset(&c, 0, sizeof(c));
  c.palette_id = 1;
  c.rows[0] = static_cast<uint8_t>(m);  // A: m tokens x 64 bytes
  c.colsb[0] = 64;
  c.rows[1] = 16;                       // B: 16 x 64 bytes
  c.colsb[1] = 64;
  c.rows[2] = static_cast<uint8_t>(m);  // C: m x 16 x 4 bytes
  c.colsb[2] = 64;
  tile_loadconfig(c);
}

// Activation rows are not contiguous (one pointer per token): gather up to 16 rows of 64 bytes.
void gather_a(const uint8_t* const* A, int m, size_t off, uint8_t* buf) {
  for (int t = 0; t < m; ++t) std::memcpy(buf + 64 * t, A[t] + off, 64);
}

void gemm_i8_amx(const GemmArgs& g) {
  const int np = (g.nr + kPanelRows - 1) / kPanelRows;
  const size_t panel_bytes = static_cast<size_t>(kPanelRows) * g.Kpad;
  const int ng = g.Kpad / kI8Group;
  alignas(64) uint8_t abuf[16 * 64];
  alignas(64) int32_t cbuf[16 * 16];
  for (int t0 = 0; t0 < g.nt; t0 += 16) {
    const int m = g.nt - t0 < 16 ? g.nt - t0 : 16;
    config_tiles(m);
    for (int p = 0; p < np; ++p) {
      const uint8_t* P = g.W + p * panel_bytes;
      float acc[16][16];
      std::memset(acc, 0, sizeof(acc));
      for (int grp = 0; grp < ng; ++grp) {
        _tile_zero(2);
        for (int c = 0; c < kI8Group / 64; ++c) {
          const size_t k0 = static_cast<size_t>(grp) * kI8Group + 64 * c;
          gather_a(g.A + t0, m, k0, abuf);
          KT_TILE_LOADD(0, abuf, 64);
          KT_TILE_LOADD(1, P + k0 * 16, 64);
          _tile_dpbssd(2, 0, 1);
        }
        KT_TILE_STORED(2, cbuf, 64);
        for (int t = 0; t < m; ++t) {
          const float* d = reinterpret_cast<const float*>(g.A[t0 + t] + g.Kpad);
          for (int r = 0; r < 16; ++r) acc[t][r] += cbuf[16 * t + r] * d[grp];
        }
      }
      const int r0 = p * kPanelRows;
      const int nrow = g.nr - r0 < 16 ? g.nr - r0 : 16;
      for (int t = 0; t < m; ++t)
        for (int r = 0; r < nrow; ++r) g.C[static_cast<size_t>(t0 + t) * g.ldc + r0 + r] = acc[t][r] * g.w_scale[r0 + r];
    }
  }
  _tile_release();
}

void gemm_bf16_amx(const GemmArgs& g) {
  const int np = (g.nr + kPanelRows - 1) / kPanelRows;
  const size_t panel_bytes = static_cast<size_t>(kPanelRows) * g.Kpad * 2;
  alignas(64) uint8_t abuf[16 * 64];
  alignas(64) float cbuf[16 * 16];
  for (int t0 = 0; t0 < g.nt; t0 += 16) {
    const int m = g.nt - t0 < 16 ? g.nt - t0 : 16;
    config_tiles(m);
    for (int p = 0; p < np; ++p) {
      const uint8_t* P = g.W + p * panel_bytes;
      _tile_zero(2);
      for (int k0 = 0; k0 < g.Kpad; k0 += 32) {  // 32 bf16 = 64 bytes per tile row
        gather_a(g.A + t0, m, 2 * static_cast<size_t>(k0), abuf);
        KT_TILE_LOADD(0, abuf, 64);
        KT_TILE_LOADD(1, P + static_cast<size_t>(k0) * 2 * 16, 64);
        _tile_dpbf16ps(2, 0, 1);
      }
      KT_TILE_STORED(2, cbuf, 64);
      const int r0 = p * kPanelRows;
      const int nrow = g.nr - r0 < 16 ? g.nr - r0 : 16;
      for (int t = 0; t < m; ++t)
        for (int r = 0; r < nrow; ++r) g.C[static_cast<size_t>(t0 + t) * g.ldc + r0 + r] = cbuf[16 * t + r];
    }
  }
  _tile_release();
}

}  // namespace

GemmFn amx_gemm_i8() { return gemm_i8_amx; }
GemmFn amx_gemm_bf16() { return gemm_bf16_amx; }

}  // namespace kt
