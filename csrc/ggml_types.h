// GGML tensor types: ids (as stored in GGUF), block geometry and scalar helpers.
// Torch-independent; shared by every translation unit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace kt {

// Values are the GGUF / ggml type ids.
enum GgmlType : int {
  GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7,
  GGML_Q8_0 = 8, GGML_Q8_1 = 9, GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13,
  GGML_Q6_K = 14, GGML_Q8_K = 15, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23, GGML_BF16 = 30,
  GGML_MXFP4 = 39,
  // low-bit grid types (code books in iq_grids.h)
  GGML_IQ2_XXS = 16, GGML_IQ2_XS = 17, GGML_IQ3_XXS = 18, GGML_IQ1_S = 19, GGML_IQ3_S = 21,
  GGML_IQ2_S = 22, GGML_IQ1_M = 29,
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
