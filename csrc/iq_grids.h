// Code books of the low-bit IQ types (llama.cpp's iq*_grid) and the IQ2/IQ3 sign table, defined
// in iq_grids.cpp, which scripts/gen_iq_grids.py generates from gguf-py.  Plain data: safe to
// use from translation units compiled for any ISA.
#pragma once
#include <cstdint>

namespace kt {

extern const uint64_t kIq2xxsGrid[256];  // 8 values each, bytes 0x08 / 0x19 / 0x2b
extern const uint64_t kIq2xsGrid[512];
extern const uint64_t kIq2sGrid[1024];
extern const uint32_t kIq3xxsGrid[256];  // 4 values each
extern const uint32_t kIq3sGrid[512];
extern const uint64_t kIq1sGrid[2048];   // 8 int8 values each in {-1, 0, 1} (IQ1_S and IQ1_M)
extern const uint8_t kKsignsIq2xs[128];  // 7 stored sign bits -> 8 (bit 7 = parity)
extern const uint64_t kKsignsIq2xsMask[128];  // the same as 8 bytes of -1 (bit set) / +1, for vpsignb

}  // namespace kt
