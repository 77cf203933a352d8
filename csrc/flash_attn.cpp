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
  const IsaTier t = active_tier();
  if (t >= IsaTier::AVX512BF16)
    flash_attn_prefill_avx512(pool, a, bf16_pv);
  else if (t >= IsaTier::AVX512)
    flash_attn_prefill_avx512f(pool, a);
  else
    flash_attn_prefill_avx2(pool, a);
}

}  // namespace kt
