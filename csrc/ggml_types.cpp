#include "ggml_types.h"

#include <stdexcept>

#include "ggml_blocks.h"
#include "iq_grids.h"

namespace kt {
namespace {
#define KT_FP16(h) fp16_to_f32(h)
#include "dequant.inc"

struct TypeTable {
  TypeInfo t[kMaxGgmlType];
  TypeTable() {
    for (auto& e : t) e = TypeInfo{nullptr, 0, 0, false};
    t[GGML_F32] = {"F32", 1, 4, true};
    t[GGML_F16] = {"F16", 1, 2, true};
    t[GGML_BF16] = {"BF16", 1, 2, true};
    t[GGML_Q4_0] = {"Q4_0", 32, 18, true};
    t[GGML_Q4_1] = {"Q4_1", 32, 20, true};
    t[GGML_Q5_0] = {"Q5_0", 32, 22, true};
    t[GGML_Q5_1] = {"Q5_1", 32, 24, true};
    t[GGML_Q8_0] = {"Q8_0", 32, 34, true};
    t[GGML_Q8_1] = {"Q8_1", 32, 40, false};
    t[GGML_Q2_K] = {"Q2_K", 256, 84, true};
    t[GGML_Q3_K] = {"Q3_K", 256, 110, true};
    t[GGML_Q4_K] = {"Q4_K", 256, 144, true};
    t[GGML_Q5_K] = {"Q5_K", 256, 176, true};
    t[GGML_Q6_K] = {"Q6_K", 256, 210, true};
    t[GGML_Q8_K] = {"Q8_K", 256, 292, false};
    t[GGML_IQ4_NL] = {"IQ4_NL", 32, 18, true};
    t[GGML_IQ4_XS] = {"IQ4_XS", 256, 136, true};
    t[GGML_MXFP4] = {"MXFP4", 32, 17, true};
    t[GGML_IQ2_XXS] = {"IQ2_XXS", 256, 66, true};
    t[GGML_IQ2_XS] = {"IQ2_XS", 256, 74, true};
    t[GGML_IQ2_S] = {"IQ2_S", 256, 82, true};
    t[GGML_IQ3_XXS] = {"IQ3_XXS", 256, 98, true};
    t[GGML_IQ3_S] = {"IQ3_S", 256, 110, true};
    t[GGML_IQ1_S] = {"IQ1_S", 256, 50, true};
    t[GGML_IQ1_M] = {"IQ1_M", 256, 56, true};
  }
};
const TypeTable& table() {
  static const TypeTable tt;
  return tt;
}
}  // namespace

const TypeInfo& type_info(int type) {
  if (type < 0 || type >= kMaxGgmlType || !table().t[type].name)
    throw std::invalid_argument("unknown ggml type id " + std::to_string(type));
  return table().t[type];
}

bool type_supported(int type) {
  return type >= 0 && type < kMaxGgmlType && table().t[type].name && table().t[type].supported;
}

void check_row_len(int type, int64_t cols, const std::string& what) {
  const TypeInfo& ti = type_info(type);
  if (!ti.supported) throw std::invalid_argument(what + ": ggml type " + ti.name + " is not supported by the CPU kernels");
  if (cols <= 0 || cols % ti.block_elems != 0)
    throw std::invalid_argument(what + ": " + ti.name + " stores rows in blocks of " + std::to_string(ti.block_elems) +
                                " elements, but the row length is " + std::to_string(cols) + " (must be a positive multiple of " +
                                std::to_string(ti.block_elems) + ")");
}

size_t row_bytes(int type, int64_t cols) {
  const TypeInfo& ti = type_info(type);
  check_row_len(type, cols, "row_bytes");
  return static_cast<size_t>(cols / ti.block_elems) * ti.block_bytes;
}

void dequantize_row_ref(int type, const void* src, float* dst, int64_t n) {
  check_row_len(type, n, "dequantize");
  dequant_row_impl(type, src, dst, n);
}

}  // namespace kt
