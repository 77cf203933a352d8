// GGML tensor types: ids (as stored in GGUF), block geometry and scalar helpers.
// Torch-independent; shared by every translation unit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace kt {

// The one list of GGML types: X(name, GGUF / ggml type id, elements per block (1 for the float
// types), bytes per block, usable as a weight type by the kernels, the stem of its dequantiser
// dq_<stem> in dequant.inc -- none: no weight of that type is read --, the stem of its reference
// quantizer q_<stem> in quantize_ref.cpp -- none: the converter does not write it here).  The enum
// below, type_info()'s table (ggml_types.cpp), the reference dequantisation's dispatch (dequant.inc)
// and the quantizers' (quantize_ref.cpp) are built from it; weights/ggml_types.py is Python's row
// per type, checked against type_info() by tests/weights/test_type_table.py.  A new type is one row
// here, its dq_ (and q_) function and its kernels.
#define KT_GGML_TYPES(X)                       \
  X(F32, 0, 1, 4, true, f32, none)             \
  X(F16, 1, 1, 2, true, f16, none)             \
  X(Q4_0, 2, 32, 18, true, q4_0, none)         \
  X(Q4_1, 3, 32, 20, true, q4_1, none)         \
  X(Q5_0, 6, 32, 22, true, q5_0, none)         \
  X(Q5_1, 7, 32, 24, true, q5_1, none)         \
  X(Q8_0, 8, 32, 34, true, q8_0, none)         \
  X(Q8_1, 9, 32, 40, false, none, none)        \
  X(Q2_K, 10, 256, 84, true, q2_K, none)       \
  X(Q3_K, 11, 256, 110, true, q3_K, none)      \
  X(Q4_K, 12, 256, 144, true, q4_K, q4_K)      \
  X(Q5_K, 13, 256, 176, true, q5_K, q5_K)      \
  X(Q6_K, 14, 256, 210, true, q6_K, q6_K)      \
  X(Q8_K, 15, 256, 292, false, none, none)     \
  X(IQ2_XXS, 16, 256, 66, true, iq2_xxs, none) \
  X(IQ2_XS, 17, 256, 74, true, iq2_xs, none)   \
  X(IQ3_XXS, 18, 256, 98, true, iq3_xxs, none) \
  X(IQ1_S, 19, 256, 50, true, iq1_s, none)     \
  X(IQ4_NL, 20, 32, 18, true, iq4_nl, iq4_nl)  \
  X(IQ3_S, 21, 256, 110, true, iq3_s, none)    \
  X(IQ2_S, 22, 256, 82, true, iq2_s, none)     \
  X(IQ4_XS, 23, 256, 136, true, iq4_xs, iq4_xs)\
  X(IQ1_M, 29, 256, 56, true, iq1_m, none)     \
  X(BF16, 30, 1, 2, true, bf16, none)          \
  X(MXFP4, 39, 32, 17, true, mxfp4, none)

enum GgmlType : int {
#define KT_TYPE_ENUM(name, id, elems, bytes, supported, dq, q) GGML_##name = id,
  KT_GGML_TYPES(KT_TYPE_ENUM)
#undef KT_TYPE_ENUM
};
constexpr int kMaxGgmlType = 40;

struct TypeInfo {
  const char* name;
  int block_elems;   // elements per block (1 for float types)
  int block_bytes;   // bytes per block
  bool supported;    // usable as a weight type by the kernels
};

const TypeInfo& type_info(int type);  // throws std::invalid_argument for unknown ids
bool type_supported(int type);
// Bytes of one row of `cols` elements; throws if cols is not a multiple of the block size.
size_t row_bytes(int type, int64_t cols);
// Throws std::invalid_argument naming `what` if rows of `cols` elements cannot be stored in `type`.
void check_row_len(int type, int64_t cols, const std::string& what);

// Reference (scalar, baseline ISA) dequantisation of n elements, n a multiple of the block size.
void dequantize_row_ref(int type, const void* src, float* dst, int64_t n);

static inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_from_f32(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u = bits_from_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
// (static: internal linkage, so ISA-specific TUs never share a COMDAT copy.)
// IEEE half -> float without F16C (exact, handles subnormals/inf/nan).
static inline float fp16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r = sign | (two_w < (1u << 27) ? bits_from_f32(denormalized) : bits_from_f32(normalized));
  return f32_from_bits(r);
}

}  // namespace kt
