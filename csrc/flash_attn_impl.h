// The prompt flash kernels' shared arguments (flash_attn.cpp dispatches, flash_attn_avx512.cpp and
// flash_attn_avx2.cpp compute).  Strides in floats; the last dimension (D) contiguous.
#pragma once
#include <cstddef>
#include <cstdint>

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
  const int64_t* pages;  // null: key j at row j; else a block table (key j at slot pages[j / ps] * ps + j % ps)
  int page_size;
  // offset in floats of key / value j (head 0) from k / v
  size_t row(int j) const {
    return pages ? static_cast<size_t>(pages[j / page_size] * page_size + j % page_size) * kv_tok
                 : static_cast<size_t>(j) * kv_tok;
  }
};

// AVX512-BF16 tier and up: fp32, or P V on bf16 pairs (bf16_pv)
void flash_attn_prefill_avx512(ThreadPool& pool, const FlashArgs& a, bool bf16_pv);
// AVX2 + FMA (and AVX-512 without BF16): fp32 throughout
void flash_attn_prefill_avx2(ThreadPool& pool, const FlashArgs& a);

}  // namespace kt
