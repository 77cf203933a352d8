// Byte-exact ggml block layouts (see ggml-common.h upstream).  Plain data only: no functions,
// so this header is safe to include from translation units compiled for different ISAs.
#pragma once
#include <cstdint>

namespace kt {

constexpr int QK_K = 256;

struct block_q4_0 { uint16_t d; uint8_t qs[16]; };
struct block_q4_1 { uint16_t d, m; uint8_t qs[16]; };
struct block_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct block_q5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct block_q8_0 { uint16_t d; int8_t qs[32]; };
struct block_q2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct block_q3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct block_q4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct block_q5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
struct block_iq4_nl { uint16_t d; uint8_t qs[16]; };
struct block_mxfp4 { uint8_t e; uint8_t qs[16]; };  // E8M0 shared exponent + 32 e2m1 nibbles
struct block_iq4_xs { uint16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };

// low-bit grid types: indices into the code books of iq_grids.h, sign bits, sub-block scales
struct block_iq2_xxs { uint16_t d; uint16_t qs[QK_K / 8]; };
struct block_iq2_xs { uint16_t d; uint16_t qs[QK_K / 8]; uint8_t scales[QK_K / 32]; };
struct block_iq2_s { uint16_t d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t scales[QK_K / 32]; };  // qs: indices | signs
struct block_iq3_xxs { uint16_t d; uint8_t qs[3 * QK_K / 8]; };  // qs: indices | scales-and-signs
struct block_iq3_s { uint16_t d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t signs[QK_K / 8]; uint8_t scales[QK_K / 64]; };
struct block_iq1_s { uint16_t d; uint8_t qs[QK_K / 8]; uint16_t qh[QK_K / 32]; };
struct block_iq1_m { uint8_t qs[QK_K / 8]; uint8_t qh[QK_K / 16]; uint8_t scales[QK_K / 32]; };  // fp16 d in the top nibbles of scales

static_assert(sizeof(block_iq2_xxs) == 66, "iq2_xxs");
static_assert(sizeof(block_iq2_xs) == 74, "iq2_xs");
static_assert(sizeof(block_iq2_s) == 82, "iq2_s");
static_assert(sizeof(block_iq3_xxs) == 98, "iq3_xxs");
static_assert(sizeof(block_iq3_s) == 110, "iq3_s");
static_assert(sizeof(block_iq1_s) == 50, "iq1_s");
static_assert(sizeof(block_iq1_m) == 56, "iq1_m");
static_assert(sizeof(block_q4_0) == 18, "q4_0");
static_assert(sizeof(block_q4_1) == 20, "q4_1");
static_assert(sizeof(block_q5_0) == 22, "q5_0");
static_assert(sizeof(block_q5_1) == 24, "q5_1");
static_assert(sizeof(block_q8_0) == 34, "q8_0");
static_assert(sizeof(block_q2_K) == 84, "q2_K");
static_assert(sizeof(block_q3_K) == 110, "q3_K");
static_assert(sizeof(block_q4_K) == 144, "q4_K");
static_assert(sizeof(block_q5_K) == 176, "q5_K");
static_assert(sizeof(block_q6_K) == 210, "q6_K");
static_assert(sizeof(block_iq4_nl) == 18, "iq4_nl");
static_assert(sizeof(block_iq4_xs) == 136, "iq4_xs");
static_assert(sizeof(block_mxfp4) == 17, "mxfp4");

}  // namespace kt
