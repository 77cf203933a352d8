// Causal prompt attention and the decode step's chunks: checks and the tier's kernel
// (flash_attn_avx512.cpp on AVX512-BF16 and up, flash_attn_avx512f.cpp on AVX-512 without BF16,
// flash_attn_avx2.cpp on AVX2 + FMA), and the chunk
// merge both share.  Compiled at the baseline: nothing here may run an instruction the CPU lacks
// before the tier is known, and the merge's arithmetic (no fma contraction) is one for every tier.
#include "flash_attn.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "cpu_features.h"
#include "flash_attn_impl.h"

namespace kt {

bool flash_attn_supported() { return active_tier() >= IsaTier::AVX2 && cpu_features().fma; }

bool flash_decode_supported(int D) { return flash_attn_supported() && D > 0 && D % 64 == 0 && D <= 512; }

// noinline: the build links with LTO, which would otherwise inline this into the tier files and
// compile it there with FMA contraction (a*x + b*y as one fma) -- other bits than the callers at
// the baseline get.  Here it is one body, compiled without FMA, for every caller.
__attribute__((noinline)) void merge_chunk(float* O, float* M, float* L, const float* o, float m, float l, int D,
                                           bool first) {
  if (first) {
    std::copy(o, o + D, O);
    *M = m;
    *L = l;
    return;
  }
  const float mn = *M > m ? *M : m;
  const float a = std::exp2(*M - mn), b = std::exp2(m - mn);
  *M = mn;
  *L = *L * a + l * b;
  for (int i = 0; i < D; ++i) O[i] = O[i] * a + o[i] * b;
}

__attribute__((noinline)) void finish_row(const float* O, float L, float* out, int D) {
  const float inv = 1.f / L;
  for (int i = 0; i < D; ++i) out[i] = O[i] * inv;
}

namespace {
void prefill_on_tier(ThreadPool& pool, const FlashArgs& a, bool bf16_pv) {
  const IsaTier t = active_tier();
  if (t >= IsaTier::AVX512BF16)
    flash_attn_prefill_avx512(pool, a, bf16_pv);
  else if (t >= IsaTier::AVX512)
    flash_attn_prefill_avx512f(pool, a);
  else
    flash_attn_prefill_avx2(pool, a);
}
}  // namespace

void flash_decode_chunk(const FlashArgs& a, int g, int c0, bool bf16_pv, float* part) {
  const IsaTier t = active_tier();
  if (t >= IsaTier::AVX512BF16)
    flash_decode_chunk_avx512(a, g, c0, bf16_pv, part);
  else if (t >= IsaTier::AVX512)
    flash_decode_chunk_avx512f(a, g, c0, part);
  else
    flash_decode_chunk_avx2(a, g, c0, part);
}

void flash_attn_prefill(ThreadPool& pool, const float* q, size_t q_tok, size_t q_head, const float* k, const float* v,
                        size_t kv_head, size_t kv_tok, float* out, size_t o_tok, size_t o_head, int H, int Hkv, int T,
                        int D, int start, int window, float scale, bool bf16_pv, const int64_t* pages,
                        int page_size, int key_first) {
  if (!flash_attn_supported()) throw std::runtime_error("flash_attn_prefill: the CPU tier has no AVX2 + FMA");
  if (H <= 0 || Hkv <= 0 || H % Hkv || T <= 0 || D <= 0 || D % 64 || D > 512 || start < 0 || window < 0)
    throw std::invalid_argument("flash_attn_prefill: need H % Hkv == 0, T > 0, D % 64 == 0 and <= 512, start >= 0 (got H " +
                                std::to_string(H) + ", Hkv " + std::to_string(Hkv) + ", T " + std::to_string(T) +
                                ", D " + std::to_string(D) + ", start " + std::to_string(start) + ")");
  if (pages && page_size < 1) throw std::invalid_argument("flash_attn_prefill: page_size must be >= 1");
  const int lo = window > 0 && start - window + 1 > 0 ? start - window + 1 : 0;  // the first visible key
  if (key_first < 0 || key_first > lo || (pages && key_first))
    throw std::invalid_argument("flash_attn_prefill: key_first must be in 0 .. the first visible key, without pages");
  const FlashArgs a{q, q_tok, q_head, k, v, kv_head, kv_tok, out, o_tok, o_head, H, Hkv, T, D, start, window, scale,
                    pages, page_size, key_first};
  prefill_on_tier(pool, a, bf16_pv);
}

bool mla_attention_supported(int C, int R) {
  return flash_attn_supported() && C > 0 && C % 64 == 0 && C <= 512 && R > 0 && R % 8 == 0 &&
         C + R <= flash::kMaxD;
}

namespace {
using HeadRowsFn = void (*)(const float*, size_t, size_t, const float*, int, int, float*, size_t, size_t, int, int,
                            int);

// out[t, h] = x[t, h] W[h] for every row and head: a task per (4 rows, head)
void head_matmul(ThreadPool& pool, const float* x, size_t x_tok, size_t x_head, const float* W, int K, int N,
                 float* out, size_t o_tok, size_t o_head, int T, int H) {
  const HeadRowsFn fn = active_tier() >= IsaTier::AVX512 ? head_rows_avx512 : head_rows_avx2;
  const int nb = (T + 3) / 4;
  pool.parallel_for(nb * H, [&](int task, int) {
    const int h = task % H, t0 = task / H * 4;
    fn(x, x_tok, x_head, W + static_cast<size_t>(h) * K * N, K, N, out, o_tok, o_head, h, t0, std::min(4, T - t0));
  });
}
}  // namespace

void mla_attention(ThreadPool& pool, const MlaArgs& m) {
  if (!mla_attention_supported(m.C, m.R))
    throw std::invalid_argument("mla_attention: need AVX2 + FMA, kv_lora_rank a multiple of 64 up to 512 and a rope "
                                "width a positive multiple of 8 (got " + std::to_string(m.C) + ", " + std::to_string(m.R) + ")");
  if (m.T <= 0 || m.H <= 0 || m.nope <= 0 || m.v <= 0 || m.start < 0 || (m.pages && m.page_size < 1))
    throw std::invalid_argument("mla_attention: need T, H, nope, v > 0, start >= 0 (and page_size >= 1 with pages)");
  const int T = m.T, H = m.H, C = m.C, D = m.C + m.R;
  thread_local std::vector<float> qbuf, obuf, part;
  qbuf.resize(static_cast<size_t>(T) * H * D);
  obuf.resize(static_cast<size_t>(T) * H * C);
  float* q = qbuf.data();
  float* ol = obuf.data();
  // the query: [q_nope W_UK | q_pe] per row and head
  head_matmul(pool, m.q_nope, m.qn_tok, m.qn_head, m.w_uk, m.nope, C, q, static_cast<size_t>(H) * D, D, T, H);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      std::copy(m.q_pe + static_cast<size_t>(t) * m.qp_tok + static_cast<size_t>(h) * m.qp_head,
                m.q_pe + static_cast<size_t>(t) * m.qp_tok + static_cast<size_t>(h) * m.qp_head + m.R,
                q + (static_cast<size_t>(t) * H + h) * D + C);
  FlashArgs a{q, static_cast<size_t>(H) * D, static_cast<size_t>(D), m.latent, m.latent, 0, m.lat_tok, ol,
              static_cast<size_t>(H) * C, static_cast<size_t>(C), H, 1, T, D, m.start, 0, m.scale, m.pages,
              m.page_size, 0};
  a.k2 = m.rope_key;
  a.k2_tok = m.rk_tok;
  a.Dk1 = C;
  a.Dv = C;
  a.item_tokens = std::max(1, 128 / H);  // ~128 rows per item: many heads share each key block
  if (T == 1) {  // a decode row: its chunks in parallel, merged in order (the prompt kernel's bits)
    const int nc = m.start / kChunk + 1;
    const size_t width = static_cast<size_t>(H) * (C + 2);
    part.resize(nc * width);
    float* P = part.data();
    pool.parallel_for(nc, [&](int c, int) { flash_decode_chunk(a, 0, c * kChunk, false, P + c * width); });
    std::vector<float> tot(C + 2);
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < nc; ++c) {
        const float* pc = P + c * width + static_cast<size_t>(h) * (C + 2);
        merge_chunk(tot.data(), &tot[C], &tot[C + 1], pc, pc[C], pc[C + 1], C, c == 0);
      }
      finish_row(tot.data(), tot[C + 1], ol + static_cast<size_t>(h) * C, C);
    }
  } else {
    prefill_on_tier(pool, a, false);
  }
  // the output: o_lat W_UV^T per row and head
  head_matmul(pool, ol, static_cast<size_t>(H) * C, C, m.w_uv_t, C, m.v, m.out, m.o_tok, m.o_head, T, H);
}

}  // namespace kt
