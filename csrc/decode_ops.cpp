// fp32 helpers of the lean single-token decode step (ktransformers/generation/decode_step.py): each
// replaces several torch ops (an RMSNorm is ~10 of them on the CPU) with one call on the calling
// thread (the attention of a deep cache on the kernels' pool).  Pointers are plain ints from
// data_ptr(); the Python side owns and checks the buffers.
#include <pybind11/pybind11.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_features.h"
#include "exp2_simd.h"
#include "thread_pool.h"

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

// Store one token's k, v [hkv, d] into a cache layer (keys/values [hkv, cap, d], head stride cap * d)
// at `slot` (roll != 0: shift every head's entries left by one first and store last, the layout of
// a full sliding-window layer), add 1 to *len (an int64 counter; 0 = none), then attend the hq
// query heads (GQA: head i reads kv head i / (hq / hkv)) to the first n entries: out [hq, d].
//
// The attention is split like flash-decoding: the n entries are cut into chunks of kChunk keys (a
// fixed size, so the result is the same for any thread count), a pool task (kv head, chunk)
// computes for the query heads reading that kv head the chunk's max m, sum l and unnormalised
// P V, and the calling thread merges each head's chunks in order.  At depth (thousands of
// entries) this reads the cache on every core; a single chunk (n <= kChunk) is plain softmax.
constexpr int kChunk = 256;
constexpr float kLog2e = 1.4426950408889634f;

// 2^x for x <= 0 (a score minus its max): exp2_simd.h
inline __attribute__((always_inline)) float exp2_neg(float x) { return exp2_scalar(x); }

// 16 partial sums (one zmm, two ymm), folded in a fixed tree
inline __attribute__((always_inline)) float dot16(const float* __restrict a, const float* __restrict b, int n) {
  float acc[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int t = 0; t < 16; ++t) acc[t] += a[i + t] * b[i + t];
  for (int t = 0; t < 8; ++t) acc[t] += acc[t + 8];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

struct AttendJob {
  const float* q;  // [hq, d]
  const float* K;  // head g at K + g * head
  const float* V;
  size_t head;
  int hq, hkv, d, n, nchunk;
  float scale;
  float* part;  // [hkv][nchunk][group][d + 2]: P V, m, l
};

// One task: kv head g, keys [c * kChunk, ...) for the group's query heads.
inline __attribute__((always_inline)) void attend_chunk_body(const AttendJob& a, int g, int c) {
  const int group = a.hq / a.hkv, d = a.d;
  const int j0 = c * kChunk;
  const int nk = a.n - j0 < kChunk ? a.n - j0 : kChunk;
  const float* K = a.K + g * a.head + static_cast<size_t>(j0) * d;
  const float* V = a.V + g * a.head + static_cast<size_t>(j0) * d;
  thread_local std::vector<float> qs, sc;
  if (qs.size() < static_cast<size_t>(group) * d) qs.resize(static_cast<size_t>(group) * d);
  if (sc.size() < static_cast<size_t>(group) * kChunk) sc.resize(static_cast<size_t>(group) * kChunk);
  const float qscale = a.scale * kLog2e;
  for (int h = 0; h < group; ++h)
    for (int i = 0; i < d; ++i) qs[h * d + i] = a.q[static_cast<size_t>(g * group + h) * d + i] * qscale;
  for (int j = 0; j < nk; ++j) {  // every key once, for all heads of the group
    const float* kj = K + static_cast<size_t>(j) * d;
    for (int h = 0; h < group; ++h) sc[h * kChunk + j] = dot16(qs.data() + h * d, kj, d);
  }
  float* part = a.part + static_cast<size_t>(g * a.nchunk + c) * group * (d + 2);
  for (int h = 0; h < group; ++h) {
    float* s = sc.data() + h * kChunk;
    float m = -INFINITY;
    for (int j = 0; j < nk; ++j) m = s[j] > m ? s[j] : m;
    for (int j = 0; j < nk; ++j) s[j] = exp2_neg(s[j] - m);
    float l8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int j = 0;
    for (; j + 8 <= nk; j += 8)
      for (int t = 0; t < 8; ++t) l8[t] += s[j + t];
    float l = ((l8[0] + l8[4]) + (l8[1] + l8[5])) + ((l8[2] + l8[6]) + (l8[3] + l8[7]));
    for (; j < nk; ++j) l += s[j];
    float* acc = part + h * (d + 2);
    std::memset(acc, 0, sizeof(float) * d);
    acc[d] = m;
    acc[d + 1] = l;
  }
  for (int j = 0; j < nk; ++j) {  // every value once, for all heads of the group
    const float* vj = V + static_cast<size_t>(j) * d;
    for (int h = 0; h < group; ++h) {
      float* __restrict acc = part + h * (d + 2);
      const float p = sc[h * kChunk + j];
      for (int i = 0; i < d; ++i) acc[i] += p * vj[i];
    }
  }
}

void attend_chunk_base(const AttendJob& a, int g, int c) { attend_chunk_body(a, g, c); }
__attribute__((target("avx2,fma"))) void attend_chunk_avx2(const AttendJob& a, int g, int c) {
  attend_chunk_body(a, g, c);
}
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void attend_chunk_avx512(const AttendJob& a, int g, int c) {
  attend_chunk_body(a, g, c);
}

// Register-blocked chunk kernels for head sizes 64 / 128 / 256 (decode_attend.inc), one copy per tier.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx2,fma")
namespace z512 {
using vec = __m512;
constexpr int W = 16, CB = 8;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vhmax(vec v) { return _mm512_reduce_max_ps(v); }
inline vec vexp2(vec x) { return exp2_ps512(x); }
#include "decode_attend.inc"
}  // namespace z512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace y256 {
using vec = __m256;
constexpr int W = 8, CB = 4;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float vhmax(vec v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
inline vec vexp2(vec x) { return exp2_ps256(x); }
#include "decode_attend.inc"
}  // namespace y256
#pragma GCC pop_options

using ChunkFn = void (*)(const AttendJob&, int, int);
// The tier's kernel for head size d: register-blocked for 64 / 128 / 256, else the generic loops.
ChunkFn chunk_fn(int d) {
  const IsaTier t = active_tier();
  if (t >= IsaTier::AVX512) {
    if (d == 64) return z512::attend_chunk<4>;
    if (d == 128) return z512::attend_chunk<8>;
    if (d == 256) return z512::attend_chunk<16>;
    return attend_chunk_avx512;
  }
  if (t >= IsaTier::AVX2 && cpu_features().fma) {
    if (d == 64) return y256::attend_chunk<8>;
    if (d == 128) return y256::attend_chunk<16>;
    if (d == 256) return y256::attend_chunk<32>;
    return attend_chunk_avx2;
  }
  return attend_chunk_base;
}

void attend(CPUInfer& ci, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t keys, uintptr_t values, int hq, int hkv,
            int d, int cap, int slot, int roll, int n, float scale, uintptr_t len, uintptr_t out) {
  if (hkv <= 0 || hq % hkv != 0 || d <= 0 || n <= 0 || n > cap || slot < 0 || slot >= cap)
    throw std::invalid_argument("attend: need hq % hkv == 0, 0 < n <= cap, 0 <= slot < cap");
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
  const int group = hq / hkv;
  const int nchunk = (n + kChunk - 1) / kChunk;
  thread_local std::vector<float> part;
  part.resize(static_cast<size_t>(hkv) * nchunk * group * (d + 2));
  const AttendJob job{ptr<const float>(q), K, V, head, hq, hkv, d, n, nchunk, scale, part.data()};
  const ChunkFn fn = chunk_fn(d);
  const int tasks = hkv * nchunk;
  if (static_cast<size_t>(n) * hkv * d < 32768) {  // under ~256 KB of keys and values: not worth a wake-up
    for (int t = 0; t < tasks; ++t) fn(job, t / nchunk, t % nchunk);
  } else {
    py::gil_scoped_release nogil;
    ci.run_now([&] { ci.pool().parallel_for(tasks, [&](int t, int) { fn(job, t / nchunk, t % nchunk); }); });
  }
  for (int hi = 0; hi < hq; ++hi) {  // merge each head's chunks in order
    const int g = hi / group, h = hi % group;
    const float* p0 = part.data() + (static_cast<size_t>(g) * nchunk * group + h) * (d + 2);
    const size_t stride = static_cast<size_t>(group) * (d + 2);
    float M = -INFINITY;
    for (int c = 0; c < nchunk; ++c) M = p0[c * stride + d] > M ? p0[c * stride + d] : M;
    float* o = ptr<float>(out) + static_cast<size_t>(hi) * d;
    std::memset(o, 0, sizeof(float) * d);
    float denom = 0;
    for (int c = 0; c < nchunk; ++c) {
      const float* pc = p0 + c * stride;
      const float w = std::exp2(pc[d] - M);
      denom += w * pc[d + 1];
      for (int i = 0; i < d; ++i) o[i] += w * pc[i];
    }
    const float inv = 1.0f / denom;
    for (int i = 0; i < d; ++i) o[i] *= inv;
  }
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
  d.def("attend", &attend, py::arg("cpu_infer"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keys"), py::arg("values"),
        py::arg("hq"), py::arg("hkv"), py::arg("d"), py::arg("cap"), py::arg("slot"), py::arg("roll"), py::arg("n"),
        py::arg("scale"), py::arg("len"), py::arg("out"));
  d.def("moe_route", &moe_route, py::arg("logits"), py::arg("num_experts"), py::arg("top_k"), py::arg("norm"),
        py::arg("ids"), py::arg("weights"));
}

}  // namespace kt
