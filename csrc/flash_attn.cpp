// Causal prompt attention: checks and the tier's kernel (flash_attn_avx512.cpp on AVX512-BF16 and
// up, flash_attn_avx2.cpp on AVX2 + FMA).  Compiled at the baseline: nothing here may run an
// instruction the CPU lacks before the tier is known.
#include "flash_attn.h"

#include <stdexcept>
#include <string>

#include "cpu_features.h"
#include "flash_attn_impl.h"

namespace kt {

bool flash_attn_supported() { return active_tier() >= IsaTier::AVX2 && cpu_features().fma; }

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
  if (active_tier() >= IsaTier::AVX512BF16)
    flash_attn_prefill_avx512(pool, a, bf16_pv);
  else
    flash_attn_prefill_avx2(pool, a);
}

}  // namespace kt
