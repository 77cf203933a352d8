// The single ISA dispatch point: picks one kernel table from active_tier() on first use.
#include <cstdlib>
#include <string>
#include <stdexcept>

#include "cpu_features.h"
#include "kernels.h"

namespace kt {

const char* act_fmt_name(ActFmt f) {
  switch (f) {
    case ActFmt::F32: return "f32";
    case ActFmt::BF16: return "bf16";
    case ActFmt::Q8_32: return "q8_32";
    case ActFmt::Q8_256: return "q8_256";
    case ActFmt::I8_G128: return "i8_g128";
    case ActFmt::U8_G128: return "u8_g128";
  }
  return "?";
}

size_t act_row_bytes(ActFmt f, int Kpad) {
  size_t b = 0;
  switch (f) {
    case ActFmt::F32: b = 4ull * Kpad; break;
    case ActFmt::BF16: b = 2ull * Kpad; break;
    case ActFmt::Q8_32: b = Kpad + 8ull * (Kpad / 32); break;
    case ActFmt::Q8_256: b = Kpad + 4ull * (Kpad / 256) + 2ull * (Kpad / 16) + 2ull * (Kpad / 32); break;
    case ActFmt::I8_G128:
    case ActFmt::U8_G128: b = Kpad + 8ull * (Kpad / kI8Group); break;
  }
  return (b + 63) & ~size_t(63);
}

namespace {
KernelTable make_table() {
  switch (active_tier()) {
    case IsaTier::Scalar: return *kernel_table_scalar();
    case IsaTier::AVX2: return *kernel_table_avx2();
    case IsaTier::AVXVNNI: return *kernel_table_avxvnni();
    case IsaTier::AVX512: return *kernel_table_avx512();
    case IsaTier::AVX512VNNI: return *kernel_table_avx512vnni();
    case IsaTier::AVX512BF16: return *kernel_table_avx512bf16();
    case IsaTier::AMX: {
      // the avx512bf16 table; with KT_AMX_TILES=1 tile kernels for calls of many tokens (same
      // activation formats and packed layouts, few-token calls go on to that table's kernels,
      // kern_amx.cpp).  The tiles round differently from those kernels, so a row's bits would
      // depend on how many tokens share its call: off by default (batch invariance).
      KernelTable t = *kernel_table_avx512bf16();
      t.name = "amx";
      const char* tiles = std::getenv("KT_AMX_TILES");
      if (!tiles || std::string(tiles) != "1") return t;
      t.packed_i8 = amx_gemm_i8(t.packed_i8);
      t.packed_bf16 = amx_gemm_bf16(t.packed_bf16);
      t.packed_prefill[0] = "i8_amx_2x2";
      t.packed_prefill[1] = "bf16_amx_2x2";
      amx_llamafile_prefill(t);
      return t;
    }
  }
  throw std::logic_error("unknown ISA tier");
}
}  // namespace

const KernelTable& kernels() {
  static const KernelTable t = make_table();  // active_tier() throws on a bad KT_ISA
  return t;
}

}  // namespace kt
