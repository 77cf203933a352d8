// fp32 helpers of the lean decode step (ktransformers/generation/decode_step.py: N rows, one token
// each, over a page pool or one cache layer): each replaces several torch ops (an RMSNorm is ~10 of
// them on the CPU) with one call on the calling thread (the attention on the kernels' pool).
// Pointers are plain ints from data_ptr(); the Python side owns and checks the buffers.
#include <pybind11/pybind11.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_features.h"
#include "exp2_simd.h"
#include "flash_attn.h"
#include "flash_attn_impl.h"
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

// The residual stream between two sublayers, row by row: x += norm(a) * wa (Gemma's sandwich norm; wa == 0:
// x += a), then out = norm(x) * w (the next sublayer's input norm).
void residual_norm(uintptr_t x, uintptr_t a, uintptr_t wa, float eps_a, uintptr_t w, float eps, uintptr_t out, int rows,
                   int n) {
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
    if (out) norm_row(xs, ptr<const float>(w), ptr<float>(out) + static_cast<size_t>(r) * n, n, eps);
  }
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

// Rotary embedding of a prompt's q or k: x [T tokens][H heads][d] read with strides (st, sh)
// floats (a transposed [1, H, T, d] view), out [T][H][d] contiguous, token t rotated with row t of
// cos / sin [T][d].  The same arithmetic as rope() above and as transformers' rotate-half
// apply_rotary_pos_emb (a product each, then a sum; this file is built without FMA contraction),
// so the bits equal torch's; one pass over the tensor where torch makes six.
void rope_prompt(CPUInfer& ci, uintptr_t x, int T, int H, int d, int64_t st, int64_t sh, uintptr_t cos, uintptr_t sin,
                 uintptr_t out) {
  if (T <= 0 || H <= 0 || d <= 0 || d % 2) throw std::invalid_argument("rope_prompt: need T, H > 0 and an even d");
  const float* src = ptr<const float>(x);
  const float* c = ptr<const float>(cos);
  const float* s = ptr<const float>(sin);
  float* o = ptr<float>(out);
  const int h = d / 2, per = 16;
  ci.pool().parallel_for((T + per - 1) / per, [&](int task, int) {
    for (int t = task * per; t < std::min(T, (task + 1) * per); ++t) {
      const float* ct = c + static_cast<size_t>(t) * d;
      const float* sn = s + static_cast<size_t>(t) * d;
      for (int j = 0; j < H; ++j) {
        const float* v = src + t * st + j * sh;
        float* w = o + (static_cast<size_t>(t) * H + j) * d;
        for (int i = 0; i < h; ++i) {
          const float a = v[i], b = v[i + h];
          w[i] = a * ct[i] + (-b) * sn[i];
          w[i + h] = b * ct[i + h] + a * sn[i + h];
        }
      }
    }
  });
}

// Decode attention (attend_rows below): keys in chunks of kChunk (flash_attn_impl.h) at absolute
// positions, each chunk a pool task, merged in order (merge_chunk).
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

// One chunk task: the group's query heads over up to kChunk keys, each key and value row found
// through a pointer (a page pool or one cache layer: the same arithmetic whatever the layout).
struct ChunkJob {
  const float* q;           // the group's query heads [group, d] (unscaled)
  const float* const* kr;   // [nk] key rows
  const float* const* vr;   // [nk] value rows
  int group, d, nk;
  float scale;
  float* part;  // [group][d + 2]: P V, m, l
};

// The generic chunk kernel (any head size): every key once, for all heads of the group.
inline __attribute__((always_inline)) void attend_chunk_body(const ChunkJob& a) {
  const int group = a.group, d = a.d, nk = a.nk;
  thread_local std::vector<float> qs, sc;
  if (qs.size() < static_cast<size_t>(group) * d) qs.resize(static_cast<size_t>(group) * d);
  if (sc.size() < static_cast<size_t>(group) * kChunk) sc.resize(static_cast<size_t>(group) * kChunk);
  const float qscale = a.scale * kLog2e;
  for (int h = 0; h < group; ++h)
    for (int i = 0; i < d; ++i) qs[h * d + i] = a.q[static_cast<size_t>(h) * d + i] * qscale;
  for (int j = 0; j < nk; ++j)
    for (int h = 0; h < group; ++h) sc[h * kChunk + j] = dot16(qs.data() + h * d, a.kr[j], d);
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
    float* acc = a.part + h * (d + 2);
    std::memset(acc, 0, sizeof(float) * d);
    acc[d] = m;
    acc[d + 1] = l;
  }
  for (int j = 0; j < nk; ++j) {
    const float* vj = a.vr[j];
    for (int h = 0; h < group; ++h) {
      float* __restrict acc = a.part + h * (d + 2);
      const float p = sc[h * kChunk + j];
      for (int i = 0; i < d; ++i) acc[i] += p * vj[i];
    }
  }
}

void attend_chunk_base(const ChunkJob& a) { attend_chunk_body(a); }
__attribute__((target("avx2,fma"))) void attend_chunk_avx2(const ChunkJob& a) {
  attend_chunk_body(a);
}
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void attend_chunk_avx512(const ChunkJob& a) {
  attend_chunk_body(a);
}

// The variant of a helper for the tier in force: this file is built for the baseline, each helper
// also as target("avx2,fma") and target("avx512f,...") functions of one body.
template <class F>
F tier_variant(F base, F avx2, F avx512) {
  const IsaTier t = active_tier();
  if (t >= IsaTier::AVX512) return avx512;
  if (t >= IsaTier::AVX2 && cpu_features().fma) return avx2;
  return base;
}

using ChunkFn = void (*)(const ChunkJob&);
// The tier's generic chunk kernel: head sizes the prompt flash kernel does not read (not a multiple
// of 64, or a tier without AVX2 + FMA); the others take flash_decode_chunk.
ChunkFn chunk_fn() { return tier_variant<ChunkFn>(attend_chunk_base, attend_chunk_avx2, attend_chunk_avx512); }

// The rows of one decode step: N single-token rows, each of its own sequence (a page pool) or one
// row of one cache layer.  Key / value row of position p of row r, kv head g:
//   keys + slot(r, p) * tok + g * head,  slot = pages[offsets[r] + p / page_size] * page_size +
//   p % page_size (page_size > 0), else p - lo[r] (a cache layer holding positions lo[r] ..).
struct Rows {
  float* qkv;  // [N, (hq + 2 hkv) d]: q heads, k heads, v heads of each row
  int hq, hkv, d;
  const float* qk_w;  // [(hq + hkv), d] q_norm / k_norm weights per head, or null
  float qk_eps;
  const float* cos;  // [N, d] (each row's own position)
  const float* sin;
  float* keys;
  float* values;
  size_t tok, head;  // strides in floats
  int page_size;
  const int64_t* pages;    // block tables, flat (page_size > 0)
  const int64_t* offsets;  // [N + 1]
  const int64_t* pos;      // [N] position of each row's new token
  const int64_t* lo;       // [N] first position each row's query sees
  float scale;
  float* out;  // [N, hq d]
  bool flash, bf16_pv;  // chunks on the prompt kernel's arithmetic (flash_decode_chunk), its bf16 P V

  size_t width() const { return static_cast<size_t>(hq + 2 * hkv) * d; }
  int64_t slot(int r, int64_t p) const {
    return page_size > 0 ? pages[offsets[r] + p / page_size] * page_size + p % page_size : p - lo[r];
  }
  // Row r's keys lo .. pos are cut at the multiples of kChunk (absolute positions): the cut
  // depends on the row alone, never on the batch, the layout or the thread count.
  int chunks(int r) const { return static_cast<int>(pos[r] / kChunk - lo[r] / kChunk + 1); }

  // q-norm / k-norm and RoPE of kv group g of row r (its q heads and its k head), then its k / v
  // rows into the slot of the row's new token
  void prepare(int r, int g) const {
    float* row = qkv + r * width();
    const int group = hq / hkv;
    const float* c = cos + static_cast<size_t>(r) * d;
    const float* s = sin + static_cast<size_t>(r) * d;
    for (int i = 0; i <= group; ++i) {
      const int h = i < group ? g * group + i : hq + g;
      float* v = row + static_cast<size_t>(h) * d;
      if (qk_w) norm_row(v, qk_w + static_cast<size_t>(h) * d, v, d, qk_eps);
      rope(reinterpret_cast<uintptr_t>(v), 1, d, reinterpret_cast<uintptr_t>(c), reinterpret_cast<uintptr_t>(s));
    }
    const size_t at = static_cast<size_t>(slot(r, pos[r])) * tok + g * head;
    std::memcpy(keys + at, row + static_cast<size_t>(hq + g) * d, sizeof(float) * d);
    std::memcpy(values + at, row + static_cast<size_t>(hq + hkv + g) * d, sizeof(float) * d);
  }

  // the group's query heads of row r over chunk c of its keys, partials into part [group][d + 2]
  void attend(ChunkFn fn, int r, int g, int c, float* part) const {
    const int64_t c0 = lo[r] / kChunk;
    if (flash) {
      const float* q = qkv + r * width();
      const int p = static_cast<int>(pos[r]), l = static_cast<int>(lo[r]);
      const FlashArgs a{q, 0, static_cast<size_t>(d), keys, values, head, tok, nullptr, 0, 0, hq, hkv, 1, d, p,
                        l > 0 ? p - l + 1 : 0, scale, page_size > 0 ? pages + offsets[r] : nullptr, page_size,
                        page_size > 0 ? 0 : l};
      flash_decode_chunk(a, g, static_cast<int>((c0 + c) * kChunk), bf16_pv, part);
      return;
    }
    const int64_t a = std::max(lo[r], (c0 + c) * kChunk), b = std::min(pos[r] + 1, (c0 + c + 1) * kChunk);
    thread_local const float* kr[kChunk];
    thread_local const float* vr[kChunk];
    for (int64_t p = a; p < b; ++p) {
      const size_t at = static_cast<size_t>(slot(r, p)) * tok + g * head;
      kr[p - a] = keys + at;
      vr[p - a] = values + at;
    }
    const int group = hq / hkv;
    const ChunkJob job{qkv + r * width() + static_cast<size_t>(g) * group * d, kr, vr, group, d,
                       static_cast<int>(b - a), scale, part};
    fn(job);
  }
};

// One layer's attention for N single-token rows: q/k norm, RoPE, K/V written, then each row's query
// heads over its own keys in chunks of kChunk at absolute positions (flash-decoding style: a pool
// task per (row, kv head, chunk) computes the chunk's max m, sum l and unnormalised P V for the
// query heads reading that kv head; the calling thread merges each head's chunks in order).  The
// same bits for a row whatever the rows beside it, the thread count, or whether its keys sit in a
// page pool or a cache layer.  `roll` (one row, a cache layer of `cap` slots): shift the layer's
// entries left by one first (a full sliding-window layer); `len`: an int64 counter to add 1 to.
void attend_rows(CPUInfer& ci, uintptr_t qkv, int n_rows, int hq, int hkv, int d, uintptr_t qk_w, float qk_eps,
                 uintptr_t cos, uintptr_t sin, uintptr_t keys, uintptr_t values, int64_t tok, int64_t head,
                 int page_size, uintptr_t pages, uintptr_t offsets, uintptr_t pos, uintptr_t lo, int roll, int cap,
                 uintptr_t len, float scale, uintptr_t out, bool bf16_pv) {
  if (n_rows < 1 || hq < 1 || hkv < 1 || hq % hkv || d < 2 || d % 2 || tok < 1 || head < 0 || page_size < 0)
    throw std::invalid_argument("attend_rows: bad shape (rows, hq % hkv, even d, strides)");
  if (page_size == 0 && (n_rows != 1 || cap < 1)) throw std::invalid_argument("attend_rows: a cache layer takes one row");
  const Rows R{ptr<float>(qkv), hq, hkv, d, ptr<const float>(qk_w), qk_eps, ptr<const float>(cos),
               ptr<const float>(sin), ptr<float>(keys), ptr<float>(values), static_cast<size_t>(tok),
               static_cast<size_t>(head), page_size, ptr<const int64_t>(pages), ptr<const int64_t>(offsets),
               ptr<const int64_t>(pos), ptr<const int64_t>(lo), scale, ptr<float>(out), flash_decode_supported(d),
               bf16_pv};
  for (int r = 0; r < n_rows; ++r)
    if (R.lo[r] < 0 || R.lo[r] > R.pos[r] || (page_size == 0 && R.pos[r] - R.lo[r] >= cap))
      throw std::invalid_argument("attend_rows: need 0 <= lo <= pos (and pos - lo < cap)");
  if (roll) {
    for (int g = 0; g < hkv; ++g) {
      float* kh = R.keys + g * R.head;
      float* vh = R.values + g * R.head;
      const size_t n = (static_cast<size_t>(cap) - 1) * R.tok;
      std::memmove(kh, kh + R.tok, sizeof(float) * n);
      std::memmove(vh, vh + R.tok, sizeof(float) * n);
    }
  }
  const int group = hq / hkv;
  std::vector<int> ns(n_rows);
  std::vector<size_t> part_at(n_rows + 1, 0);
  struct Task {
    int r, g, c;
  };
  thread_local std::vector<Task> tasks_tl;  // the caller's (a name of a thread_local in a pool task is the worker's)
  std::vector<Task>& tasks = tasks_tl;
  tasks.clear();
  size_t keys_read = 0;
  for (int r = 0; r < n_rows; ++r) {
    ns[r] = R.chunks(r);
    part_at[r + 1] = part_at[r] + static_cast<size_t>(hkv) * ns[r] * group * (d + 2);
    keys_read += static_cast<size_t>(R.pos[r] - R.lo[r] + 1);
    for (int g = 0; g < hkv; ++g)
      for (int c = 0; c < ns[r]; ++c) tasks.push_back({r, g, c});
  }
  thread_local std::vector<float> part;
  part.resize(part_at[n_rows]);
  float* P = part.data();
  const ChunkFn fn = chunk_fn();
  auto run_task = [&](int i) {
    const Task& t = tasks[i];
    R.attend(fn, t.r, t.g, t.c, P + part_at[t.r] + (static_cast<size_t>(t.g) * ns[t.r] + t.c) * group * (d + 2));
  };
  const int n_tasks = static_cast<int>(tasks.size());
  py::gil_scoped_release nogil;  // a server's other threads run meanwhile, whichever branch
  if (keys_read * hkv * d < 32768) {  // under ~256 KB of keys and values: not worth a wake-up
    for (int r = 0; r < n_rows; ++r)
      for (int g = 0; g < hkv; ++g) R.prepare(r, g);
    for (int i = 0; i < n_tasks; ++i) run_task(i);
  } else if (n_tasks == n_rows * hkv) {  // one chunk per row: each task prepares the keys it reads
    ci.run_now([&] {
      ci.pool().parallel_for(n_tasks, [&](int i, int) {
        R.prepare(tasks[i].r, tasks[i].g);
        run_task(i);
      });
    });
  } else {
    ci.run_now([&] {
      ci.pool().parallel_for(n_rows * hkv, [&](int t, int) { R.prepare(t / hkv, t % hkv); });
      ci.pool().parallel_for(n_tasks, [&](int i, int) { run_task(i); });
    });
  }
  if (len) ++*ptr<int64_t>(len);
  for (int r = 0; r < n_rows; ++r) {  // merge each head's chunks in order
    const int nc = ns[r];
    thread_local std::vector<float> tot;
    tot.resize(static_cast<size_t>(d) + 2);
    for (int hi = 0; hi < hq; ++hi) {
      const int g = hi / group, h = hi % group;
      const float* p0 = P + part_at[r] + (static_cast<size_t>(g) * nc * group + h) * (d + 2);
      const size_t stride = static_cast<size_t>(group) * (d + 2);
      for (int c = 0; c < nc; ++c) {
        const float* pc = p0 + c * stride;
        merge_chunk(tot.data(), &tot[d], &tot[d + 1], pc, pc[d], pc[d + 1], d, c == 0);
      }
      finish_row(tot.data(), tot[d + 1], R.out + (static_cast<size_t>(r) * hq + hi) * d, d);
    }
  }
}

// The softmax-top-k router of transformers' Qwen2/3-MoE for `rows` tokens (row r's logits at
// logits + r * stride): p = softmax(logits[E]), the k largest p in descending order (the lower
// expert id first on equal p) -> ids[r][k] (int64), their p -> w[r][k], divided by their sum when
// `norm` (norm_topk_prob).  Each row alone, in one fixed order: the prompt's MoE block and the
// decode step route a token to the same bits.  Top-k by k passes over E: k and E are small (8 of
// 128), and no sort / allocation is needed.
void moe_route(uintptr_t logits, int E, int k, bool norm, uintptr_t ids, uintptr_t w, int rows, int stride) {
  if (E <= 0 || k <= 0 || k > E) throw std::invalid_argument("moe_route: need 0 < k <= E");
  if (rows < 1 || (stride != 0 && stride < E)) throw std::invalid_argument("moe_route: need rows >= 1, stride >= E");
  if (stride == 0) stride = E;
  thread_local std::vector<float> p;
  if (static_cast<int>(p.size()) < E) p.resize(E);
  for (int r = 0; r < rows; ++r) {
    const float* l = ptr<const float>(logits) + static_cast<size_t>(r) * stride;
    float m = -INFINITY;
    for (int e = 0; e < E; ++e) m = l[e] > m ? l[e] : m;
    float sum = 0;
    for (int e = 0; e < E; ++e) {
      p[e] = std::exp(l[e] - m);
      sum += p[e];
    }
    const float inv = 1.0f / sum;
    for (int e = 0; e < E; ++e) p[e] *= inv;
    int64_t* id = ptr<int64_t>(ids) + static_cast<size_t>(r) * k;
    float* wt = ptr<float>(w) + static_cast<size_t>(r) * k;
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
}


// ---------------------------------------------------------------------------------------------
// Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the causal depthwise conv and the gated
// delta rule, token by token.  Each token's outputs and state come from the same operations in the
// same order whatever the chunk it arrives in (one token, a prompt chunk, a whole prompt), so a
// prompt read whole, in chunks or after a cached prefix, and the decode steps, all leave the same
// bits.  (transformers' chunked form reads a prompt in 64-token chunks of its own: its sums depend
// on where a call starts.)  The math is transformers' recurrent form.

// out[t][c] = silu(sum_j w[c][j] * x[c][s + t + j]) for t < T, the taps added in order, x the
// channel-major [C][L] window (L >= T + K - 1: s = L - T - K + 1 earlier columns skipped).
inline __attribute__((always_inline)) void conv_silu_body(const float* x, int C, int L, const float* w, int K, int T,
                                                          float* out, int c0, int c1) {
  const int s = L - T - K + 1;
  for (int c = c0; c < c1; ++c) {
    const float* xc = x + static_cast<size_t>(c) * L + s;
    const float* wc = w + static_cast<size_t>(c) * K;
    for (int t = 0; t < T; ++t) {
      float acc = wc[0] * xc[t];
      for (int j = 1; j < K; ++j) acc = acc + wc[j] * xc[t + j];
      out[static_cast<size_t>(t) * C + c] = acc / (1.0f + std::exp(-acc));
    }
  }
}

struct DeltaJob {
  const float* qkv;  // [T][C]: q [hk][dk], k [hk][dk], v [hv][dv]
  const float* b;    // [T][hv] (b_stride floats a token)
  const float* a;
  int64_t b_stride, a_stride;
  const float* A_log;
  const float* dt_bias;
  float* state;  // [hv][dk][dv]
  float* out;    // [T][hv][dv]
  int T, C, hk, hv, dk, dv;
};

// One value head h over the T tokens; kv / qn / kn: scratch of dv, dk, dk floats.
inline __attribute__((always_inline)) void delta_head_body(const DeltaJob& j, int h, float* kv, float* qn, float* kn) {
  const int dk = j.dk, dv = j.dv, kh = h / (j.hv / j.hk);
  const size_t key_dim = static_cast<size_t>(j.hk) * dk;
  float* S = j.state + static_cast<size_t>(h) * dk * dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  const float A = std::exp(j.A_log[h]);
  for (int t = 0; t < j.T; ++t) {
    const float* row = j.qkv + static_cast<size_t>(t) * j.C;
    const float* q = row + static_cast<size_t>(kh) * dk;
    const float* k = row + key_dim + static_cast<size_t>(kh) * dk;
    const float* v = row + 2 * key_dim + static_cast<size_t>(h) * dv;
    float sq = 0.f, sk = 0.f;
    for (int i = 0; i < dk; ++i) sq = sq + q[i] * q[i];
    for (int i = 0; i < dk; ++i) sk = sk + k[i] * k[i];
    const float iq = 1.0f / std::sqrt(sq + 1e-6f), ik = 1.0f / std::sqrt(sk + 1e-6f);
    for (int i = 0; i < dk; ++i) qn[i] = (q[i] * iq) * scale;
    for (int i = 0; i < dk; ++i) kn[i] = k[i] * ik;
    const float bb = j.b[t * j.b_stride + h], aa = j.a[t * j.a_stride + h] + j.dt_bias[h];
    const float beta = 1.0f / (1.0f + std::exp(-bb));
    const float sp = aa > 20.f ? aa : std::log1p(std::exp(aa));  // softplus (torch's threshold 20)
    const float decay = std::exp(-A * sp);
    // S *= decay; kv = k^T S
    for (int e = 0; e < dv; ++e) kv[e] = 0.f;
    for (int i = 0; i < dk; ++i) {
      float* Si = S + static_cast<size_t>(i) * dv;
      const float ki = kn[i];
      for (int e = 0; e < dv; ++e) {
        Si[e] = Si[e] * decay;
        kv[e] = kv[e] + Si[e] * ki;
      }
    }
    for (int e = 0; e < dv; ++e) kv[e] = (v[e] - kv[e]) * beta;  // delta
    // S += k delta^T; out = q^T S
    float* o = j.out + (static_cast<size_t>(t) * j.hv + h) * dv;
    for (int e = 0; e < dv; ++e) o[e] = 0.f;
    for (int i = 0; i < dk; ++i) {
      float* Si = S + static_cast<size_t>(i) * dv;
      const float ki = kn[i], qi = qn[i];
      for (int e = 0; e < dv; ++e) {
        Si[e] = Si[e] + ki * kv[e];
        o[e] = o[e] + Si[e] * qi;
      }
    }
  }
}

void conv_silu_base(const float* x, int C, int L, const float* w, int K, int T, float* out, int c0, int c1) {
  conv_silu_body(x, C, L, w, K, T, out, c0, c1);
}
__attribute__((target("avx2,fma"))) void conv_silu_avx2(const float* x, int C, int L, const float* w, int K, int T,
                                                        float* out, int c0, int c1) {
  conv_silu_body(x, C, L, w, K, T, out, c0, c1);
}
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void conv_silu_avx512(const float* x, int C, int L,
                                                                          const float* w, int K, int T, float* out,
                                                                          int c0, int c1) {
  conv_silu_body(x, C, L, w, K, T, out, c0, c1);
}
void delta_head_base(const DeltaJob& j, int h, float* kv, float* qn, float* kn) { delta_head_body(j, h, kv, qn, kn); }
__attribute__((target("avx2,fma"))) void delta_head_avx2(const DeltaJob& j, int h, float* kv, float* qn, float* kn) {
  delta_head_body(j, h, kv, qn, kn);
}
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void delta_head_avx512(const DeltaJob& j, int h, float* kv,
                                                                           float* qn, float* kn) {
  delta_head_body(j, h, kv, qn, kn);
}

// The conv of one chunk: x [C][L] channel-major (the cache's window then the chunk), w [C][K] ->
// out [T][C], the pool splitting the channels.
void conv_silu(CPUInfer& ci, uintptr_t x, int C, int L, uintptr_t w, int K, int T, uintptr_t out) {
  if (C <= 0 || K <= 0 || T <= 0 || L < T + K - 1)
    throw std::invalid_argument("conv_silu: need C, K, T > 0 and L >= T + K - 1");
  const auto fn = tier_variant(conv_silu_base, conv_silu_avx2, conv_silu_avx512);
  const int per = 64, n = (C + per - 1) / per;
  ci.pool().parallel_for(n, [&](int task, int) {
    fn(ptr<const float>(x), C, L, ptr<const float>(w), K, T, ptr<float>(out), task * per, std::min(C, (task + 1) * per));
  });
}

// The gated delta rule over T tokens of one sequence, the pool splitting the value heads; the
// state [hv][dk][dv] is read and updated in place.
void gated_delta_rule(CPUInfer& ci, uintptr_t qkv, int T, int C, int hk, int hv, int dk, int dv, uintptr_t b,
                      int64_t b_stride, uintptr_t a, int64_t a_stride, uintptr_t A_log, uintptr_t dt_bias,
                      uintptr_t state, uintptr_t out) {
  if (T <= 0 || hk <= 0 || hv <= 0 || hv % hk || dk <= 0 || dv <= 0 || C != 2 * hk * dk + hv * dv)
    throw std::invalid_argument("gated_delta_rule: need T > 0, hv a multiple of hk, C = 2 hk dk + hv dv");
  const DeltaJob j{ptr<const float>(qkv), ptr<const float>(b), ptr<const float>(a), b_stride, a_stride,
                   ptr<const float>(A_log), ptr<const float>(dt_bias), ptr<float>(state), ptr<float>(out),
                   T, C, hk, hv, dk, dv};
  const auto fn = tier_variant(delta_head_base, delta_head_avx2, delta_head_avx512);
  ci.pool().parallel_for(hv, [&](int h, int) {
    thread_local std::vector<float> scratch;  // a decode step calls this per layer: no allocation per head
    scratch.resize(static_cast<size_t>(dv) + 2 * static_cast<size_t>(dk));
    fn(j, h, scratch.data(), scratch.data() + dv, scratch.data() + dv + dk);
  });
}
}  // namespace

void register_decode_ops(py::module_& m) {
  auto d = m.def_submodule("decode_ops", "fp32 helpers of the lean decode step (one token per row, N rows)");
  d.def("rms_norm", &rms_norm, py::arg("x"), py::arg("w"), py::arg("out"), py::arg("rows"), py::arg("n"),
        py::arg("w_stride"), py::arg("eps"));
  d.def("residual_norm", &residual_norm, py::arg("x"), py::arg("a"), py::arg("wa"), py::arg("eps_a"), py::arg("w"),
        py::arg("eps"), py::arg("out"), py::arg("rows"), py::arg("n"));
  d.def("rope", &rope, py::arg("x"), py::arg("rows"), py::arg("d"), py::arg("cos"), py::arg("sin"));
  d.def("rope_prompt", &rope_prompt, py::arg("cpu_infer"), py::arg("x"), py::arg("T"), py::arg("H"), py::arg("d"),
        py::arg("st"), py::arg("sh"), py::arg("cos"), py::arg("sin"), py::arg("out"));
  d.def("attend_rows", &attend_rows, py::arg("cpu_infer"), py::arg("qkv"), py::arg("rows"), py::arg("hq"),
        py::arg("hkv"), py::arg("d"), py::arg("qk_w"), py::arg("qk_eps"), py::arg("cos"), py::arg("sin"),
        py::arg("keys"), py::arg("values"), py::arg("tok_stride"), py::arg("head_stride"), py::arg("page_size"),
        py::arg("pages"), py::arg("offsets"), py::arg("pos"), py::arg("lo"), py::arg("roll"), py::arg("cap"),
        py::arg("len"), py::arg("scale"), py::arg("out"), py::arg("bf16_pv") = false);
  d.def("conv_silu", &conv_silu, py::arg("cpu_infer"), py::arg("x"), py::arg("C"), py::arg("L"), py::arg("w"),
        py::arg("K"), py::arg("T"), py::arg("out"));
  d.def("gated_delta_rule", &gated_delta_rule, py::arg("cpu_infer"), py::arg("qkv"), py::arg("T"), py::arg("C"),
        py::arg("hk"), py::arg("hv"), py::arg("dk"), py::arg("dv"), py::arg("b"), py::arg("b_stride"), py::arg("a"),
        py::arg("a_stride"), py::arg("A_log"), py::arg("dt_bias"), py::arg("state"), py::arg("out"));
  d.def("moe_route", &moe_route, py::arg("logits"), py::arg("num_experts"), py::arg("top_k"), py::arg("norm"),
        py::arg("ids"), py::arg("weights"), py::arg("rows") = 1, py::arg("stride") = 0);
}

}  // namespace kt
