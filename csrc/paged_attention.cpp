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

#include "thread_pool.h"

namespace py = pybind11;

namespace kt {
namespace {

constexpr int64_t kMinSplitKeys = 64;  // a key split shorter than this costs more to merge than it saves

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

// rotate-half RoPE of one head in place (transformers' apply_rotary_pos_emb)
inline void rope_head(float* v, const float* c, const float* s, int d) {
  const int h = d / 2;
  for (int i = 0; i < h; ++i) {
    const float a = v[i], b = v[i + h];
    v[i] = a * c[i] + (-b) * s[i];
    v[i + h] = b * c[i + h] + a * s[i + h];
  }
}

struct Batch {
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

  size_t row_width() const { return static_cast<size_t>(hq + 2 * hkv) * d; }
  int64_t slot(int r, int64_t j) const { return pages[offsets[r] + j / page_size] * page_size + j % page_size; }

  // q-norm / k-norm and RoPE of kv group g of row r (its q heads and its k head), then the k/v rows
  // into the row's slot of its new token
  void prepare(int r, int g) const {
    float* row = qkv + r * row_width();
    const int group = hq / hkv;
    const float* c = cos + static_cast<size_t>(r) * d;
    const float* s = sin + static_cast<size_t>(r) * d;
    for (int i = 0; i <= group; ++i) {
      const int head = i < group ? g * group + i : hq + g;  // the group's q heads, then its k head
      float* v = row + static_cast<size_t>(head) * d;
      if (qk_w) norm_row(v, qk_w + static_cast<size_t>(head) * d, v, d, qk_eps);
      rope_head(v, c, s, d);
    }
    const size_t at = (static_cast<size_t>(slot(r, pos[r])) * hkv + g) * d;
    std::memcpy(keys + at, row + static_cast<size_t>(hq + g) * d, sizeof(float) * d);
    std::memcpy(values + at, row + static_cast<size_t>(hq + hkv + g) * d, sizeof(float) * d);
  }

  // key positions lo .. hi (inclusive) that row r's query sees
  void key_range(int r, int64_t& lo, int64_t& hi) const {
    hi = pos[r];
    lo = window > 0 && hi - window + 1 > 0 ? hi - window + 1 : 0;
  }

  // The q heads of kv group g of row r over split s (of nsplit) of the row's keys: each key and
  // value row is read once for the whole group.  nsplit == 1: the normalised result into out;
  // otherwise the split's running max, sum and unnormalised output into part_ml / part_o (merged
  // by merge()).
  void attend(int r, int g, int s, int nsplit, float* part_ml, float* part_o, std::vector<float>& p) const {
    const int G = hq / hkv;
    int64_t lo, hi;
    key_range(r, lo, hi);
    const int64_t len = hi - lo + 1;
    const int64_t a = lo + len * s / nsplit, b = lo + len * (s + 1) / nsplit;
    const int n = static_cast<int>(b - a);
    if (static_cast<int64_t>(p.size()) < static_cast<int64_t>(G) * n) p.resize(static_cast<size_t>(G) * n);
    const float* qrow = qkv + r * row_width() + static_cast<size_t>(g) * G * d;
    const size_t kstride = static_cast<size_t>(hkv) * d;
    // scores, page run by page run (no per-key division)
    for (int64_t j = a; j < b;) {
      const int64_t within = j % page_size;
      const int64_t run = std::min<int64_t>(page_size - within, b - j);
      const float* kr = keys + (static_cast<size_t>(pages[offsets[r] + j / page_size] * page_size + within) * hkv + g) * d;
      for (int64_t t = 0; t < run; ++t, kr += kstride)
        for (int h = 0; h < G; ++h) p[static_cast<size_t>(h) * n + (j - a + t)] = dot(qrow + static_cast<size_t>(h) * d, kr, d) * scale;
      j += run;
    }
    float m[64], l[64];  // G <= 64 (checked by the caller)
    for (int h = 0; h < G; ++h) {
      float* ph = p.data() + static_cast<size_t>(h) * n;
      float mh = -INFINITY;
      for (int j = 0; j < n; ++j) mh = ph[j] > mh ? ph[j] : mh;
      float sum = 0;
      for (int j = 0; j < n; ++j) {
        ph[j] = std::exp(ph[j] - mh);
        sum += ph[j];
      }
      m[h] = mh;
      l[h] = sum;
    }
    float* o0 = nsplit == 1 ? out + (static_cast<size_t>(r) * hq + g * G) * d : nullptr;
    auto o_of = [&](int h) {
      return nsplit == 1 ? o0 + static_cast<size_t>(h) * d
                         : part_o + ((static_cast<size_t>(r) * hq + g * G + h) * nsplit + s) * d;
    };
    for (int h = 0; h < G; ++h) std::memset(o_of(h), 0, sizeof(float) * d);
    for (int64_t j = a; j < b;) {
      const int64_t within = j % page_size;
      const int64_t run = std::min<int64_t>(page_size - within, b - j);
      const float* vr = values + (static_cast<size_t>(pages[offsets[r] + j / page_size] * page_size + within) * hkv + g) * d;
      for (int64_t t = 0; t < run; ++t, vr += kstride)
        for (int h = 0; h < G; ++h) {
          const float pj = p[static_cast<size_t>(h) * n + (j - a + t)];
          float* o = o_of(h);
          for (int i = 0; i < d; ++i) o[i] += pj * vr[i];
        }
      j += run;
    }
    for (int h = 0; h < G; ++h) {
      if (nsplit == 1) {
        const float inv = 1.0f / l[h];
        float* o = o_of(h);
        for (int i = 0; i < d; ++i) o[i] *= inv;
      } else {
        float* ml = part_ml + ((static_cast<size_t>(r) * hq + g * G + h) * nsplit + s) * 2;
        ml[0] = m[h];
        ml[1] = l[h];
      }
    }
  }

  // combine the splits of query head h of row r (log-sum-exp rescaling)
  void merge(int r, int h, int nsplit, const float* part_ml, const float* part_o) const {
    const size_t base = static_cast<size_t>(r) * hq + h;
    const float* ml = part_ml + base * nsplit * 2;
    float M = -INFINITY;
    for (int s = 0; s < nsplit; ++s)
      if (ml[2 * s + 1] > 0 && ml[2 * s] > M) M = ml[2 * s];
    float L = 0;
    float* o = out + base * d;
    std::memset(o, 0, sizeof(float) * d);
    for (int s = 0; s < nsplit; ++s) {
      if (!(ml[2 * s + 1] > 0)) continue;  // an empty split
      const float w = std::exp(ml[2 * s] - M);
      L += ml[2 * s + 1] * w;
      const float* po = part_o + (base * nsplit + s) * d;
      for (int i = 0; i < d; ++i) o[i] += w * po[i];
    }
    const float inv = 1.0f / L;
    for (int i = 0; i < d; ++i) o[i] *= inv;
  }
};

// One layer's attention for N single-token rows: q/k norm, RoPE, K/V into the pages, then the q
// heads of each (row, kv head) over that row's own pages (GQA: head h reads kv head h / (hq / hkv)).
// Threaded over (row, kv head); with fewer of those than twice the pool's threads, each one's keys
// are split too (flash-decoding style, merged by log-sum-exp), so one long sequence uses every thread.
void paged_decode_attention(CPUInfer& ci, uintptr_t qkv, int n_rows, int hq, int hkv, int d, uintptr_t qk_w,
                            float qk_eps, uintptr_t cos, uintptr_t sin, uintptr_t keys, uintptr_t values,
                            int page_size, uintptr_t pages, uintptr_t offsets, uintptr_t pos, int window, float scale,
                            uintptr_t out) {
  if (n_rows < 1 || hq < 1 || hkv < 1 || hq % hkv || hq / hkv > 64 || d < 2 || d % 2 || page_size < 1)
    throw std::invalid_argument("paged_decode_attention: bad shape (rows, hq % hkv, hq / hkv <= 64, even d, page_size)");
  const Batch b{ptr<float>(qkv), hq, hkv, d, ptr<const float>(qk_w), qk_eps, ptr<const float>(cos),
                ptr<const float>(sin), ptr<float>(keys), ptr<float>(values), page_size, ptr<const int64_t>(pages),
                ptr<const int64_t>(offsets), ptr<const int64_t>(pos), window, scale, ptr<float>(out)};
  py::gil_scoped_release nogil;
  ci.run_now([&] {
    ThreadPool& pool = ci.pool();
    const int tasks = n_rows * hkv;
    int64_t longest = 0;
    for (int r = 0; r < n_rows; ++r) {
      int64_t lo, hi;
      b.key_range(r, lo, hi);
      longest = std::max(longest, hi - lo + 1);
    }
    int nsplit = 1;
    if (pool.size() > 1 && tasks < 2 * pool.size())
      nsplit = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((2 * pool.size() + tasks - 1) / tasks,
                                                                        longest / kMinSplitKeys)));
    if (nsplit == 1) {
      pool.parallel_for(tasks, [&](int t, int) {
        thread_local std::vector<float> p;
        b.prepare(t / hkv, t % hkv);
        b.attend(t / hkv, t % hkv, 0, 1, nullptr, nullptr, p);
      });
      return;
    }
    for (int t = 0; t < tasks; ++t) b.prepare(t / hkv, t % hkv);  // few rows: not worth a wake-up
    thread_local std::vector<float> part_ml, part_o;
    part_ml.resize(static_cast<size_t>(n_rows) * hq * nsplit * 2);
    part_o.resize(static_cast<size_t>(n_rows) * hq * nsplit * d);
    float* ml = part_ml.data();
    float* po = part_o.data();
    pool.parallel_for(tasks * nsplit, [&](int t, int) {
      thread_local std::vector<float> p;
      const int rg = t / nsplit;
      b.attend(rg / hkv, rg % hkv, t % nsplit, nsplit, ml, po, p);
    });
    for (int t = 0; t < n_rows * hq; ++t) b.merge(t / hq, t % hq, nsplit, ml, po);
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
      const float inv = 1.0f / std::sqrt(dot(as, as, n) / static_cast<float>(n) + eps_a);
      for (int i = 0; i < n; ++i) xs[i] = xs[i] + (as[i] * inv) * ws[i];
    } else {
      for (int i = 0; i < n; ++i) xs[i] = xs[i] + as[i];
    }
    norm_row(xs, ptr<const float>(w), ptr<float>(out) + static_cast<size_t>(r) * n, n, eps);
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
