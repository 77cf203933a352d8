// The prompt flash kernels' shared arguments (flash_attn.cpp dispatches, flash_attn_avx512.cpp and
// flash_attn_avx2.cpp compute).  Strides in floats; the last dimension (D) contiguous.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

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
  // A key of two parts (MLA's latent and its rope key): columns [0, Dk1) of key j from k, columns
  // [Dk1, D) from k2 (token stride k2_tok, the same row addressing); null: all D columns from k.
  const float* k2 = nullptr;
  size_t k2_tok = 0;
  int Dk1 = 0;
  int Dv = 0;           // value width (values: the first Dv columns of v's rows); 0: D
  int item_tokens = 0;  // query tokens per prompt work item; 0: kQ
  int dv() const { return Dv > 0 ? Dv : D; }
  int dk1() const { return k2 ? Dk1 : D; }
  size_t slot(int j) const {
    return pages ? static_cast<size_t>(pages[j / page_size] * page_size + j % page_size)
                 : static_cast<size_t>(j > key_first ? j - key_first : 0);
  }
  // offset in floats of key / value j (head 0) from k / v; positions before key_first (in a block,
  // never visible) read row 0: finite values, masked out
  size_t row(int j) const { return slot(j) * kv_tok; }
};

// Keys per chunk, at absolute multiples: a row's softmax over the keys of one chunk is a partial
// (unnormalised O, max m, sum l), and a row's partials are merged in chunk order (merge_chunk).  The
// prompt (one work item walks a row's chunks in turn) and the decode step (a pool task per chunk)
// cut a row's keys at the same places and run the same arithmetic per row, so a token gives the
// same bits read as a prompt row or as a decode row.
constexpr int kChunk = 256;

// Folds a row's partial over one chunk (o [D], m, l) into its running total (O [D], M, L): the
// first partial is copied; then M' = max(M, m), O = O 2^(M - M') + o 2^(m - M'), L likewise.
// Compiled once at the baseline and never inlined (flash_attn.cpp: no fma contraction), for every
// tier and caller.
void merge_chunk(float* O, float* M, float* L, const float* o, float m, float l, int D, bool first);
// out = O / L
void finish_row(const float* O, float L, float* out, int D);

namespace flash {
namespace {  // internal linkage: each tier's file compiles these with its own flags

constexpr int kQ = 32;  // query tokens per prompt work item
constexpr int kK = 64;  // keys per block (at absolute multiples of kK; kChunk is a multiple)
constexpr int kRowAlign = 4;  // rows rounded up to whole register tiles of every tier
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kMasked = -1e30f;
constexpr int kMaxD = 1024;  // the widest key (MLA: kv_lora_rank + rope, 576 on the released models)
static_assert(kChunk % kK == 0, "chunks are whole key blocks");

// The fp32 state of one work item (kv head g, query tokens t0 .. t0 + nq - 1, at most qn of them:
// kQ for a prompt, 1 for a decode row) that every tier keeps: rows r = h * qn + t (head h of the
// group, token t0 + t; rows past nq, and the rows that round the count up to whole register tiles,
// are computed on token nq - 1 or on zero queries and dropped), the queries pre-scaled by
// scale * log2(e), the running O, max and sum of the chunk being read, and each row's total over
// the chunks closed so far.
struct WorkRows {
  int qn = kQ, rows = 0, D = 0, Dv = 0;
  std::vector<float> q, o, m, l;  // [rows][D], [rows][Dv], [rows], [rows]
  std::vector<float> to, tm, tl;  // totals: [rows][Dv], [rows], [rows]
  std::vector<uint8_t> has;       // [rows]: a total exists
  std::vector<float> kp;          // [D][kK]: a key block transposed

  void size(const FlashArgs& a, int tokens = kQ) {
    qn = tokens;
    const int G = a.H / a.Hkv;
    rows = (G * qn + kRowAlign - 1) / kRowAlign * kRowAlign;
    D = a.D;
    Dv = a.dv();
    q.assign(static_cast<size_t>(rows) * D, 0.f);
    o.assign(static_cast<size_t>(rows) * Dv, 0.f);
    m.assign(rows, 0.f);
    l.assign(rows, 0.f);
    to.assign(static_cast<size_t>(rows) * Dv, 0.f);
    tm.assign(rows, 0.f);
    tl.assign(rows, 0.f);
    has.assign(rows, 0);
    kp.assign(static_cast<size_t>(D) * kK, 0.f);
  }

  // whether a decode row of `a` fits the buffers as sized (one token per item)
  bool fits_decode(const FlashArgs& a) const { return qn == 1 && rows >= a.H / a.Hkv && D == a.D && Dv == a.dv(); }

  void reset_chunk(const FlashArgs& a) {
    std::fill(o.begin(), o.begin() + static_cast<size_t>(rows) * a.dv(), 0.f);
    std::fill(m.begin(), m.begin() + rows, -INFINITY);
    std::fill(l.begin(), l.begin() + rows, 0.f);
  }

  void start(const FlashArgs& a, int g, int t0, int nq) {
    const int D = a.D, G = a.H / a.Hkv;
    const float qs = a.scale * kLog2e;
    for (int h = 0; h < G; ++h)
      for (int t = 0; t < qn; ++t) {
        const float* qr = a.q + static_cast<size_t>(g * G + h) * a.q_head +
                          static_cast<size_t>(t0 + (t < nq - 1 ? t : nq - 1)) * a.q_tok;
        float* dst = q.data() + static_cast<size_t>(h * qn + t) * D;
        for (int d = 0; d < D; ++d) dst[d] = qr[d] * qs;
      }
    reset_chunk(a);
    std::fill(has.begin(), has.begin() + rows, 0);
  }

  // the chunk read so far into each row's total (rows that saw none of its keys keep theirs)
  void close_chunk(const FlashArgs& a) {
    const int D = a.dv();
    for (int r = 0; r < rows; ++r) {
      if (std::isinf(m[r])) continue;
      const size_t at = static_cast<size_t>(r) * D;
      merge_chunk(to.data() + at, &tm[r], &tl[r], o.data() + at, m[r], l[r], D, !has[r]);
      has[r] = 1;
    }
    reset_chunk(a);
  }

  // keys [j0, j0 + kK) of head g transposed into kp; only [jl, jh] read (zeros elsewhere).  Data
  // movement only (the same bits whichever way): 8 x 8 register transposes where the tier file has
  // AVX2 (the decode step's one row per item cannot amortise a scalar transpose).
  void pack_keys(const FlashArgs& a, int g, int j0, int jl, int jh) {
    const int D = a.D, D1 = a.dk1();
    const float* K = a.k + static_cast<size_t>(g) * a.kv_head;
#ifdef __AVX2__
    alignas(32) static const float zero[kMaxD] = {};  // a masked key's row
    for (int j = 0; j < kK; j += 8) {
      const float* r[8];
      const float* r2[8];  // the key's second part (a.k2): column d >= D1 at r2[i] + d - D1
      for (int i = 0; i < 8; ++i) {
        const int jj = j0 + j + i;
        const bool seen = jj >= jl && jj <= jh;
        r[i] = seen ? K + a.row(jj) : zero;
        r2[i] = seen && a.k2 ? a.k2 + a.slot(jj) * a.k2_tok : zero;
      }
      for (int d = 0; d < D; d += 8) {
        const float* const* src = d < D1 ? r : r2;
        const int c = d < D1 ? d : d - D1;
        const __m256 x0 = _mm256_loadu_ps(src[0] + c), x1 = _mm256_loadu_ps(src[1] + c);
        const __m256 x2 = _mm256_loadu_ps(src[2] + c), x3 = _mm256_loadu_ps(src[3] + c);
        const __m256 x4 = _mm256_loadu_ps(src[4] + c), x5 = _mm256_loadu_ps(src[5] + c);
        const __m256 x6 = _mm256_loadu_ps(src[6] + c), x7 = _mm256_loadu_ps(src[7] + c);
        const __m256 t0 = _mm256_unpacklo_ps(x0, x1), t1 = _mm256_unpackhi_ps(x0, x1);
        const __m256 t2 = _mm256_unpacklo_ps(x2, x3), t3 = _mm256_unpackhi_ps(x2, x3);
        const __m256 t4 = _mm256_unpacklo_ps(x4, x5), t5 = _mm256_unpackhi_ps(x4, x5);
        const __m256 t6 = _mm256_unpacklo_ps(x6, x7), t7 = _mm256_unpackhi_ps(x6, x7);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        float* dst = kp.data() + static_cast<size_t>(d) * kK + j;
        _mm256_storeu_ps(dst + 0 * kK, _mm256_permute2f128_ps(u0, u4, 0x20));
        _mm256_storeu_ps(dst + 1 * kK, _mm256_permute2f128_ps(u1, u5, 0x20));
        _mm256_storeu_ps(dst + 2 * kK, _mm256_permute2f128_ps(u2, u6, 0x20));
        _mm256_storeu_ps(dst + 3 * kK, _mm256_permute2f128_ps(u3, u7, 0x20));
        _mm256_storeu_ps(dst + 4 * kK, _mm256_permute2f128_ps(u0, u4, 0x31));
        _mm256_storeu_ps(dst + 5 * kK, _mm256_permute2f128_ps(u1, u5, 0x31));
        _mm256_storeu_ps(dst + 6 * kK, _mm256_permute2f128_ps(u2, u6, 0x31));
        _mm256_storeu_ps(dst + 7 * kK, _mm256_permute2f128_ps(u3, u7, 0x31));
      }
    }
#else
    for (int j = 0; j < kK; ++j) {
      if (j0 + j >= jl && j0 + j <= jh) {
        const float* kr = K + a.row(j0 + j);
        for (int d = 0; d < D1; ++d) kp[d * kK + j] = kr[d];
        if (a.k2) {
          const float* k2r = a.k2 + a.slot(j0 + j) * a.k2_tok;
          for (int d = D1; d < D; ++d) kp[d * kK + j] = k2r[d - D1];
        }
      } else {
        for (int d = 0; d < D; ++d) kp[d * kK + j] = 0.f;
      }
    }
#endif
  }

  // the rows of the item's real tokens out, O / L of their totals
  void finish(const FlashArgs& a, int g, int t0, int nq) const {
    const int D = a.dv(), G = a.H / a.Hkv;
    for (int h = 0; h < G; ++h)
      for (int t = 0; t < nq; ++t) {
        const int row = h * qn + t;
        float* dst = a.out + static_cast<size_t>(t0 + t) * a.o_tok + static_cast<size_t>(g * G + h) * a.o_head;
        finish_row(to.data() + static_cast<size_t>(row) * D, tl[row], dst, D);
      }
  }

  // a decode row's partial over one chunk: head h's O, m, l -> part[h * (D + 2) ..]
  void partial(const FlashArgs& a, float* part) const {
    const int D = a.dv(), G = a.H / a.Hkv;
    for (int h = 0; h < G; ++h) {
      const int row = h * qn;
      float* p = part + static_cast<size_t>(h) * (D + 2);
      std::copy(o.begin() + static_cast<size_t>(row) * D, o.begin() + static_cast<size_t>(row + 1) * D, p);
      p[D] = m[row];
      p[D + 1] = l[row];
    }
  }
};

// The keys [kl[r], kh[r]] within [jl, jh] that rows r0 .. r0 + R - 1 of `s` see (causal, window);
// false when none of them sees any
template <int R>
inline bool visible_keys(const FlashArgs& a, const WorkRows& s, int t0, int nq, int jl, int jh, int r0, int* kl,
                         int* kh) {
  bool any = false;
  for (int r = 0; r < R; ++r) {
    const int t = std::min((r0 + r) % s.qn, nq - 1), pos = a.start + t0 + t;
    kl[r] = std::max(jl, a.window > 0 ? pos - a.window + 1 : 0);
    kh[r] = std::min(jh, pos);
    any |= kh[r] >= kl[r];
  }
  return any;
}

// The keys [lo, hi) that some query of tokens t0 .. t0 + nq - 1 sees
inline void item_keys(const FlashArgs& a, int t0, int nq, int* lo, int* hi) {
  const int pos_first = a.start + t0, pos_last = a.start + t0 + nq - 1;
  *lo = a.window > 0 ? std::max(0, pos_first - a.window + 1) : 0;
  *hi = pos_last + 1;
}

// The key blocks of [c0, c1) that the item sees, in order: block(j0, jl, jh), keys [jl, jh] of
// block [j0, j0 + kK) seen by some row
template <class Block>
inline void each_block(int lo, int hi, int c0, int c1, Block block) {
  const int end = std::min(c1, hi);
  for (int j0 = std::max(c0, lo / kK * kK); j0 < end; j0 += kK)
    block(j0, std::max(j0, lo), std::min(j0 + kK, end) - 1);
}

// A prompt work item: its rows over each chunk of their keys in turn, each chunk closed into the
// rows' totals, then the rows out.
template <class Scratch, class Block>
void prompt_item(const FlashArgs& a, int g, int t0, int nq, Scratch& s, Block block) {
  s.start(a, g, t0, nq);
  int lo, hi;
  item_keys(a, t0, nq, &lo, &hi);
  for (int c0 = lo / kChunk * kChunk; c0 < hi; c0 += kChunk) {
    each_block(lo, hi, c0, c0 + kChunk, [&](int j0, int jl, int jh) { block(a, s, g, t0, nq, j0, jl, jh); });
    s.close_chunk(a);
  }
  s.finish(a, g, t0, nq);
}

// A decode row (a.T == 1, its token at a.start) over the chunk [c0, c0 + kChunk) of its keys: the
// group's partials (O, m, l per head) into part [G][D + 2]
template <class Scratch, class Block>
void decode_chunk(const FlashArgs& a, int g, int c0, Scratch& s, float* part, Block block) {
  s.start(a, g, 0, 1);
  int lo, hi;
  item_keys(a, 0, 1, &lo, &hi);
  each_block(lo, hi, c0, c0 + kChunk, [&](int j0, int jl, int jh) { block(a, s, g, 0, 1, j0, jl, jh); });
  s.partial(a, part);
}

// One work item per (query block, kv head) on the pool, the latest query blocks (most keys) first
// so that the short ones fill in at the end; `item(scratch, g, t0, nq)`.
// A row's bits never depend on the item it comes in, so the tokens per item (a.item_tokens: MLA's
// many heads per key take fewer) are a matter of speed only.
template <class Scratch, class Item>
void run_items(ThreadPool& pool, const FlashArgs& a, Item item) {
  const int nt = a.item_tokens > 0 ? a.item_tokens : kQ;
  const int nqb = (a.T + nt - 1) / nt, Hkv = a.Hkv;
  std::vector<Scratch> scratch(pool.size());
  for (Scratch& s : scratch) s.size(a, nt);
  pool.parallel_for(nqb * Hkv, [&](int task, int tid) {
    const int qb = nqb - 1 - task / Hkv, g = task % Hkv;
    item(scratch[tid], g, qb * nt, std::min(nt, a.T - qb * nt));
  });
}

// Rows t0 .. t0 + nt - 1 (nt <= 4) of head h of a per-head product: out[t, h, :N] = sum over k of
// x[t, h, k] W[k, :N] (W the head's [K][N] matrix), each output one fma chain in k order from 0.
// fma rounds once, so an output's bits depend on nothing but its row and W: not on nt, T, the
// thread split, the vector width or the tier.  (MLA's absorptions: W_UK into the query, W_UV after
// the weighted sum.)
template <int kT>
inline void head_rows_n(const float* x, size_t x_tok, size_t x_head, const float* W, int K, int N, float* out,
                        size_t o_tok, size_t o_head, int h, int t0) {
  constexpr int kN = 64;
  const float* xr[kT];
  float* orow[kT];
  for (int r = 0; r < kT; ++r) {
    xr[r] = x + static_cast<size_t>(t0 + r) * x_tok + static_cast<size_t>(h) * x_head;
    orow[r] = out + static_cast<size_t>(t0 + r) * o_tok + static_cast<size_t>(h) * o_head;
  }
  for (int n0 = 0; n0 < N; n0 += kN) {
    alignas(64) float acc[kT][kN] = {};
    if (n0 + kN <= N) {
      for (int k = 0; k < K; ++k) {
        const float* w = W + static_cast<size_t>(k) * N + n0;
        for (int r = 0; r < kT; ++r) {
          const float xv = xr[r][k];
          for (int n = 0; n < kN; ++n) acc[r][n] = std::fma(xv, w[n], acc[r][n]);
        }
      }
    } else {
      for (int k = 0; k < K; ++k) {
        const float* w = W + static_cast<size_t>(k) * N + n0;
        for (int r = 0; r < kT; ++r)
          for (int n = 0; n < N - n0; ++n) acc[r][n] = std::fma(xr[r][k], w[n], acc[r][n]);
      }
    }
    for (int r = 0; r < kT; ++r) std::copy(acc[r], acc[r] + std::min(kN, N - n0), orow[r] + n0);
  }
}

inline void head_rows(const float* x, size_t x_tok, size_t x_head, const float* W, int K, int N, float* out,
                      size_t o_tok, size_t o_head, int h, int t0, int nt) {
  switch (nt) {  // only the rows asked for (a decode row is one)
    case 1: return head_rows_n<1>(x, x_tok, x_head, W, K, N, out, o_tok, o_head, h, t0);
    case 2: return head_rows_n<2>(x, x_tok, x_head, W, K, N, out, o_tok, o_head, h, t0);
    case 3: return head_rows_n<3>(x, x_tok, x_head, W, K, N, out, o_tok, o_head, h, t0);
    default: return head_rows_n<4>(x, x_tok, x_head, W, K, N, out, o_tok, o_head, h, t0);
  }
}

}  // namespace
}  // namespace flash

// AVX512-BF16 tier and up: fp32, or P V on bf16 pairs (bf16_pv)
void flash_attn_prefill_avx512(ThreadPool& pool, const FlashArgs& a, bool bf16_pv);
void flash_decode_chunk_avx512(const FlashArgs& a, int g, int c0, bool bf16_pv, float* part);
// AVX-512 without BF16 (avx512, avx512vnni tiers): the same kernel, fp32 throughout
void flash_attn_prefill_avx512f(ThreadPool& pool, const FlashArgs& a);
void flash_decode_chunk_avx512f(const FlashArgs& a, int g, int c0, float* part);
// AVX2 + FMA: fp32 throughout
void flash_attn_prefill_avx2(ThreadPool& pool, const FlashArgs& a);
void flash_decode_chunk_avx2(const FlashArgs& a, int g, int c0, float* part);
// flash::head_rows compiled with each tier's flags (the same bits on every tier)
void head_rows_avx512(const float* x, size_t x_tok, size_t x_head, const float* W, int K, int N, float* out,
                      size_t o_tok, size_t o_head, int h, int t0, int nt);
void head_rows_avx2(const float* x, size_t x_tok, size_t x_head, const float* W, int K, int N, float* out,
                    size_t o_tok, size_t o_head, int h, int t0, int nt);

}  // namespace kt
