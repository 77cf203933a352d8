// fp32 helpers of the lean single-token decode step (ktransformers/operators/decode.py): each
// replaces several torch ops (an RMSNorm is ~10 of them on the CPU) with one call on the calling
// thread.  Pointers are plain ints from data_ptr(); the Python side owns and checks the buffers.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_features.h"

namespace py = pybind11;

namespace kt {
namespace {

template <class T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// 8 partial sums: the compiler keeps them in two vectors (no -ffast-math reassociation needed)
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void norm_row(const float* x, const float* w, float* out, int n, float eps) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w[r * w_stride ...]  (w_stride 0: one weight row)
void rms_norm(uintptr_t x, uintptr_t w, uintptr_t out, int rows, int n, int w_stride, float eps) {
  for (int r = 0; r < rows; ++r)
    norm_row(ptr<const float>(x) + static_cast<size_t>(r) * n, ptr<const float>(w) + static_cast<size_t>(r) * w_stride,
             ptr<float>(out) + static_cast<size_t>(r) * n, n, eps);
}

// The residual stream between two sublayers: x += norm(a) * wa (Gemma's sandwich norm; wa == 0:
// x += a), then out = norm(x) * w (the next sublayer's input norm).
void residual_norm(uintptr_t x, uintptr_t a, uintptr_t wa, float eps_a, uintptr_t w, float eps, uintptr_t out, int n) {
  float* xs = ptr<float>(x);
  const float* as = ptr<const float>(a);
  if (wa) {
    const float* ws = ptr<const float>(wa);
    const float inv = 1.0f / std::sqrt(dot(as, as, n) / static_cast<float>(n) + eps_a);
    for (int i = 0; i < n; ++i) xs[i] = xs[i] + (as[i] * inv) * ws[i];
  } else {
    for (int i = 0; i < n; ++i) xs[i] = xs[i] + as[i];
  }
  if (out) norm_row(xs, ptr<const float>(w), ptr<float>(out), n, eps);
}

// Rotary embedding of `rows` heads of d in place, rotate-half convention (transformers'
// apply_rotary_pos_emb): x' = x * cos + rotate_half(x) * sin.
void rope(uintptr_t x, int rows, int d, uintptr_t cos, uintptr_t sin) {
  const float* c = ptr<const float>(cos);
  const float* s = ptr<const float>(sin);
  const int h = d / 2;
  for (int r = 0; r < rows; ++r) {
    float* v = ptr<float>(x) + static_cast<size_t>(r) * d;
    for (int i = 0; i < h; ++i) {
      const float a = v[i], b = v[i + h];
      v[i] = a * c[i] + (-b) * s[i];
      v[i + h] = b * c[i + h] + a * s[i + h];
    }
  }
}

// Store one token's k, v [hkv, d] into a static cache layer (keys/values [hkv, cap, d]) at `slot`
// (roll != 0: shift every head's entries left by one first and store last, the layout of a full
// sliding-window layer), add 1 to *len (an int64 counter; 0 = none), then attend the hq query
// heads (GQA: head i reads kv head i / (hq / hkv)) to the first n entries: out [hq, d].
inline void axpy(float* __restrict y, float a, const float* __restrict x, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// (inlined into a baseline and an AVX2+FMA copy below; the tier in force picks one)
inline __attribute__((always_inline)) void attend_body(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t keys,
                                                       uintptr_t values, int hq, int hkv, int d, int cap, int slot,
                                                       int roll, int n, float scale, uintptr_t len, uintptr_t out) {
  float* K = ptr<float>(keys);
  float* V = ptr<float>(values);
  const size_t head = static_cast<size_t>(cap) * d;
  for (int g = 0; g < hkv; ++g) {
    float* kh = K + g * head;
    float* vh = V + g * head;
    if (roll) {
      std::memmove(kh, kh + d, sizeof(float) * (head - d));
      std::memmove(vh, vh + d, sizeof(float) * (head - d));
      slot = cap - 1;
    }
    std::memcpy(kh + static_cast<size_t>(slot) * d, ptr<const float>(k) + static_cast<size_t>(g) * d, sizeof(float) * d);
    std::memcpy(vh + static_cast<size_t>(slot) * d, ptr<const float>(v) + static_cast<size_t>(g) * d, sizeof(float) * d);
  }
  if (len) ++*ptr<int64_t>(len);
  thread_local std::vector<float> p;
  if (static_cast<int>(p.size()) < n) p.resize(n);
  const int group = hq / hkv;
  for (int hi = 0; hi < hq; ++hi) {
    const float* qh = ptr<const float>(q) + static_cast<size_t>(hi) * d;
    const float* kh = K + (hi / group) * head;
    const float* vh = V + (hi / group) * head;
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) {
      p[j] = dot(qh, kh + static_cast<size_t>(j) * d, d) * scale;
      m = p[j] > m ? p[j] : m;
    }
    float sum = 0;
    for (int j = 0; j < n; ++j) {
      p[j] = std::exp(p[j] - m);
      sum += p[j];
    }
    const float inv = 1.0f / sum;
    float* o = ptr<float>(out) + static_cast<size_t>(hi) * d;
    std::memset(o, 0, sizeof(float) * d);
    for (int j = 0; j < n; ++j) axpy(o, p[j] * inv, vh + static_cast<size_t>(j) * d, d);
  }
}

void attend_base(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t keys, uintptr_t values, int hq, int hkv, int d,
                 int cap, int slot, int roll, int n, float scale, uintptr_t len, uintptr_t out) {
  attend_body(q, k, v, keys, values, hq, hkv, d, cap, slot, roll, n, scale, len, out);
}
__attribute__((target("avx2,fma"))) void attend_avx2(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t keys,
                                                     uintptr_t values, int hq, int hkv, int d, int cap, int slot,
                                                     int roll, int n, float scale, uintptr_t len, uintptr_t out) {
  attend_body(q, k, v, keys, values, hq, hkv, d, cap, slot, roll, n, scale, len, out);
}

void attend(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t keys, uintptr_t values, int hq, int hkv, int d, int cap,
            int slot, int roll, int n, float scale, uintptr_t len, uintptr_t out) {
  static const bool wide = active_tier() >= IsaTier::AVX2 && cpu_features().fma;
  (wide ? attend_avx2 : attend_base)(q, k, v, keys, values, hq, hkv, d, cap, slot, roll, n, scale, len, out);
}

// The softmax-top-k router of transformers' Qwen2/3-MoE for one token: p = softmax(logits[E]),
// the k largest p in descending order (the lower expert id first on equal p) -> ids[k] (int64),
// their p -> w[k], divided by their sum when `norm` (norm_topk_prob).  Top-k by k passes over E:
// k and E are small (8 of 128), and no sort / allocation is needed.
void moe_route(uintptr_t logits, int E, int k, bool norm, uintptr_t ids, uintptr_t w) {
  if (E <= 0 || k <= 0 || k > E) throw std::invalid_argument("moe_route: need 0 < k <= E");
  const float* l = ptr<const float>(logits);
  thread_local std::vector<float> p;
  if (static_cast<int>(p.size()) < E) p.resize(E);
  float m = -INFINITY;
  for (int e = 0; e < E; ++e) m = l[e] > m ? l[e] : m;
  float sum = 0;
  for (int e = 0; e < E; ++e) {
    p[e] = std::exp(l[e] - m);
    sum += p[e];
  }
  const float inv = 1.0f / sum;
  for (int e = 0; e < E; ++e) p[e] *= inv;
  int64_t* id = ptr<int64_t>(ids);
  float* wt = ptr<float>(w);
  float tot = 0;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;  // chosen ones are marked -1 (NaN logits: never chosen)
    if (best < 0) throw std::invalid_argument("moe_route: router logits are not finite");
    id[j] = best;
    wt[j] = p[best];
    tot += p[best];
    p[best] = -1.f;
  }
  if (norm)
    for (int j = 0; j < k; ++j) wt[j] = wt[j] / tot;
}

}  // namespace

void register_decode_ops(py::module_& m) {
  auto d = m.def_submodule("decode_ops", "fp32 helpers of the lean single-token decode step");
  d.def("rms_norm", &rms_norm, py::arg("x"), py::arg("w"), py::arg("out"), py::arg("rows"), py::arg("n"),
        py::arg("w_stride"), py::arg("eps"));
  d.def("residual_norm", &residual_norm, py::arg("x"), py::arg("a"), py::arg("wa"), py::arg("eps_a"), py::arg("w"),
        py::arg("eps"), py::arg("out"), py::arg("n"));
  d.def("rope", &rope, py::arg("x"), py::arg("rows"), py::arg("d"), py::arg("cos"), py::arg("sin"));
  d.def("attend", &attend, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keys"), py::arg("values"),
        py::arg("hq"), py::arg("hkv"), py::arg("d"), py::arg("cap"), py::arg("slot"), py::arg("roll"), py::arg("n"),
        py::arg("scale"), py::arg("len"), py::arg("out"));
  d.def("moe_route", &moe_route, py::arg("logits"), py::arg("num_experts"), py::arg("top_k"), py::arg("norm"),
        py::arg("ids"), py::arg("weights"));
}

}  // namespace kt
