// fp32 attention of the lean batched decode step (ktransformers/generation/batch_decode.py): N
// sequences, one new token each, over the shared page pool of ktransformers/generation/paged.py.
// Pointers are plain ints from data_ptr(); the Python side owns and checks the buffers.
//
// Pool layout (per layer): keys / values [slots, hkv, d], token j of a sequence whose block table is
// `pages` sits at slot pages[j / page_size] * page_size + j % page_size.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <algorithm>
#include <vector>

#include "cpu_features.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace kt {
namespace {

constexpr int64_t kSplitKeys = 256;  // keys per split (at absolute multiples): the decode kernel's chunk

template <class T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// One layer's N rows: buffers and shapes (pointers from the Python side)
struct BatchArgs {
  float* qkv;          // [N, (hq + 2 hkv) d]: q heads, k heads, v heads of each row
  int hq, hkv, d;
  const float* qk_w;   // [(hq + hkv), d] q_norm / k_norm weights per head, or null
  float qk_eps;
  const float* cos;    // [N, d] per row (each row's own position)
  const float* sin;
  float* keys;         // pool tensors of the layer
  float* values;
  int page_size;
  const int64_t* pages;    // block tables, flat
  const int64_t* offsets;  // [N + 1] row r's pages are pages[offsets[r] .. offsets[r + 1])
  const int64_t* pos;      // [N] position of each row's new token (= its past length)
  int window;              // > 0: keys at positions > pos - window only (sliding-window layer)
  float scale;
  float* out;              // [N, hq d]
};

namespace base {
#include "paged_attention.inc"
}  // namespace base

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "paged_attention.inc"
}  // namespace avx2
#pragma GCC pop_options

// One layer's attention for N single-token rows: q/k norm, RoPE, K/V into the pages, then the q
// heads of each (row, kv head) over that row's own pages (GQA: head h reads kv head h / (hq / hkv)).
// Threaded over (row, kv head, key split): a row's keys are cut at absolute multiples of
// kSplitKeys (flash-decoding style, merged by log-sum-exp in order), the same cut whatever the
// batch or the threads, so one long sequence uses every thread and a row's bits never depend on
// the rows beside it.
void paged_decode_attention(CPUInfer& ci, uintptr_t qkv, int n_rows, int hq, int hkv, int d, uintptr_t qk_w,
                            float qk_eps, uintptr_t cos, uintptr_t sin, uintptr_t keys, uintptr_t values,
                            int page_size, uintptr_t pages, uintptr_t offsets, uintptr_t pos, int window, float scale,
                            uintptr_t out) {
  if (n_rows < 1 || hq < 1 || hkv < 1 || hq % hkv || hq / hkv > 64 || d < 2 || d % 2 || page_size < 1)
    throw std::invalid_argument("paged_decode_attention: bad shape (rows, hq % hkv, hq / hkv <= 64, even d, page_size)");
  const BatchArgs args{ptr<float>(qkv), hq, hkv, d, ptr<const float>(qk_w), qk_eps, ptr<const float>(cos),
                ptr<const float>(sin), ptr<float>(keys), ptr<float>(values), page_size, ptr<const int64_t>(pages),
                ptr<const int64_t>(offsets), ptr<const int64_t>(pos), window, scale, ptr<float>(out)};
  py::gil_scoped_release nogil;
  ci.run_now([&] {
    static const bool wide = active_tier() >= IsaTier::AVX2 && cpu_features().fma;
    (wide ? avx2::run : base::run)(ci.pool(), args, n_rows);
  });
}

// The residual stream between two sublayers for `rows` rows of n: x += norm(a) * wa (Gemma's
// sandwich norm; wa == 0: x += a), then out = norm(x) * w (the next sublayer's input norm).
void residual_norm_rows(uintptr_t x, uintptr_t a, uintptr_t wa, float eps_a, uintptr_t w, float eps, uintptr_t out,
                        int rows, int n) {
  for (int r = 0; r < rows; ++r) {
    float* xs = ptr<float>(x) + static_cast<size_t>(r) * n;
    const float* as = ptr<const float>(a) + static_cast<size_t>(r) * n;
    if (wa) {
      const float* ws = ptr<const float>(wa);
      const float inv = 1.0f / std::sqrt(base::dot(as, as, n) / static_cast<float>(n) + eps_a);
      for (int i = 0; i < n; ++i) xs[i] = xs[i] + (as[i] * inv) * ws[i];
    } else {
      for (int i = 0; i < n; ++i) xs[i] = xs[i] + as[i];
    }
    base::norm_row(xs, ptr<const float>(w), ptr<float>(out) + static_cast<size_t>(r) * n, n, eps);
  }
}

}  // namespace

void register_paged_ops(py::module_& m) {
  auto d = m.def_submodule("paged_ops", "fp32 helpers of the lean batched decode step over the page pool");
  d.def("decode_attention", &paged_decode_attention, py::arg("cpuinfer"), py::arg("qkv"), py::arg("rows"),
        py::arg("hq"), py::arg("hkv"), py::arg("d"), py::arg("qk_w"), py::arg("qk_eps"), py::arg("cos"),
        py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("page_size"), py::arg("pages"),
        py::arg("offsets"), py::arg("pos"), py::arg("window"), py::arg("scale"), py::arg("out"));
  d.def("residual_norm_rows", &residual_norm_rows, py::arg("x"), py::arg("a"), py::arg("wa"), py::arg("eps_a"),
        py::arg("w"), py::arg("eps"), py::arg("out"), py::arg("rows"), py::arg("n"));
}

}  // namespace kt
