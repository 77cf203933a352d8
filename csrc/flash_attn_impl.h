// The prompt flash kernels' shared arguments (flash_attn.cpp dispatches, flash_attn_avx512.cpp and
// flash_attn_avx2.cpp compute).  Strides in floats; the last dimension (D) contiguous.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "thread_pool.h"

namespace kt {

struct FlashArgs {
  const float* q;
  size_t q_tok, q_head;
  const float* k;
  const float* v;
  size_t kv_head, kv_tok;
  float* out;
  size_t o_tok, o_head;
  int H, Hkv, T, D, start, window;
  float scale;
  const int64_t* pages;  // null: key j at row j - key_first; else a block table (key j at slot pages[j / ps] * ps + j % ps)
  int page_size;
  int key_first;  // no block table: the position of row 0 (a rolled sliding window); every visible key is at or after it
  // offset in floats of key / value j (head 0) from k / v; positions before key_first (in a block,
  // never visible) read row 0: finite values, masked out
  size_t row(int j) const {
    return pages ? static_cast<size_t>(pages[j / page_size] * page_size + j % page_size) * kv_tok
                 : static_cast<size_t>(j > key_first ? j - key_first : 0) * kv_tok;
  }
};

namespace flash {
namespace {  // internal linkage: each tier's file compiles these with its own flags

constexpr int kQ = 32;  // query tokens per work item
constexpr int kK = 64;  // keys per block (at absolute multiples of kK)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kMasked = -1e30f;

// The fp32 state of one work item (kv head g, query tokens t0 .. t0 + nq - 1) that every tier keeps:
// rows r = h * kQ + t (head h of the group, token t0 + t; rows past nq are computed on token
// nq - 1 and dropped), the queries pre-scaled by scale * log2(e), the running O, max and sum.
struct WorkRows {
  std::vector<float> q, o, m, l;  // [rows][D], [rows][D], [rows], [rows]
  std::vector<float> kp;          // [D][kK]: a key block transposed

  void size(const FlashArgs& a) {
    const size_t rows = static_cast<size_t>(a.H / a.Hkv) * kQ, D = a.D;
    q.assign(rows * D, 0.f);
    o.assign(rows * D, 0.f);
    m.assign(rows, 0.f);
    l.assign(rows, 0.f);
    kp.assign(D * kK, 0.f);
  }

  void start(const FlashArgs& a, int g, int t0, int nq) {
    const int D = a.D, G = a.H / a.Hkv, rows = G * kQ;
    const float qs = a.scale * kLog2e;
    for (int h = 0; h < G; ++h)
      for (int t = 0; t < kQ; ++t) {
        const float* qr = a.q + static_cast<size_t>(g * G + h) * a.q_head +
                          static_cast<size_t>(t0 + (t < nq - 1 ? t : nq - 1)) * a.q_tok;
        float* dst = q.data() + static_cast<size_t>(h * kQ + t) * D;
        for (int d = 0; d < D; ++d) dst[d] = qr[d] * qs;
      }
    std::fill(o.begin(), o.begin() + static_cast<size_t>(rows) * D, 0.f);
    std::fill(m.begin(), m.begin() + rows, -INFINITY);
    std::fill(l.begin(), l.begin() + rows, 0.f);
  }

  // keys [j0, j0 + n) of head g transposed into kp (zeros past n)
  void pack_keys(const FlashArgs& a, int g, int j0, int n) {
    const int D = a.D;
    const float* K = a.k + static_cast<size_t>(g) * a.kv_head;
    for (int j = 0; j < kK; ++j) {
      if (j < n) {
        const float* kr = K + a.row(j0 + j);
        for (int d = 0; d < D; ++d) kp[d * kK + j] = kr[d];
      } else {
        for (int d = 0; d < D; ++d) kp[d * kK + j] = 0.f;
      }
    }
  }

  void finish(const FlashArgs& a, int g, int t0, int nq) const {
    const int D = a.D, G = a.H / a.Hkv;
    for (int h = 0; h < G; ++h)
      for (int t = 0; t < nq; ++t) {
        const int row = h * kQ + t;
        const float inv = 1.f / l[row];
        const float* src = o.data() + static_cast<size_t>(row) * D;
        float* dst = a.out + static_cast<size_t>(t0 + t) * a.o_tok + static_cast<size_t>(g * G + h) * a.o_head;
        for (int d = 0; d < D; ++d) dst[d] = src[d] * inv;
      }
  }
};

// The keys [kl[r], kh[r]] of block [j0, j0 + n) that rows r0 .. r0 + R - 1 see (causal, window);
// false when none of them sees any
template <int R>
inline bool visible_keys(const FlashArgs& a, int t0, int nq, int j0, int n, int r0, int* kl, int* kh) {
  bool any = false;
  for (int r = 0; r < R; ++r) {
    const int t = std::min((r0 + r) % kQ, nq - 1), pos = a.start + t0 + t;
    kl[r] = std::max(j0, a.window > 0 ? pos - a.window + 1 : 0);
    kh[r] = std::min(j0 + n - 1, pos);
    any |= kh[r] >= kl[r];
  }
  return any;
}

// One work item per (query block, kv head) on the pool, the latest query blocks (most keys) first
// so that the short ones fill in at the end; `item(scratch, g, t0, nq)`.
template <class Scratch, class Item>
void run_items(ThreadPool& pool, const FlashArgs& a, Item item) {
  const int nqb = (a.T + kQ - 1) / kQ, Hkv = a.Hkv;
  std::vector<Scratch> scratch(pool.size());
  for (Scratch& s : scratch) s.size(a);
  pool.parallel_for(nqb * Hkv, [&](int task, int tid) {
    const int qb = nqb - 1 - task / Hkv, g = task % Hkv;
    item(scratch[tid], g, qb * kQ, std::min(kQ, a.T - qb * kQ));
  });
}

}  // namespace
}  // namespace flash

// AVX512-BF16 tier and up: fp32, or P V on bf16 pairs (bf16_pv)
void flash_attn_prefill_avx512(ThreadPool& pool, const FlashArgs& a, bool bf16_pv);
// AVX2 + FMA (and AVX-512 without BF16): fp32 throughout
void flash_attn_prefill_avx2(ThreadPool& pool, const FlashArgs& a);

}  // namespace kt
