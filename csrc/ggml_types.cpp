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
#define KT_TYPE_ROW(name, id, elems, bytes, supported, dq, q) t[id] = {#name, elems, bytes, supported};
    KT_GGML_TYPES(KT_TYPE_ROW)
#undef KT_TYPE_ROW
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
