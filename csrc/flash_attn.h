// Causal prompt attention over fp32 q / k / v, flash-style (flash_attn.cpp and the tiers' kernels).
#pragma once
#include <cstddef>
#include <cstdint>

#include "thread_pool.h"

namespace kt {

// Whether the CPU tier in force runs flash_attn_prefill (AVX2 + FMA and above).
bool flash_attn_supported();

// out[t, h, :] = softmax over the keys j that query t sees (start + t - window < j <= start + t;
// window 0: no lower bound) of scale * q[h, t] . k[g, j], weighting v[g, j], with g = h / (H / Hkv).
// Strides are in floats; the last dimension (D, a multiple of 64, at most 512) is contiguous.
// The keys 0 .. start + T - 1 must be written in k / v.  bf16_pv: P V on bf16 probabilities and
// values (faster; ~2e-3 relative error; AVX512-BF16 tiers, fp32 below them), else fp32 throughout.  pages (a block table, or null):
// key j of the sequence sits at row pages[j / page_size] * page_size + j % page_size of k / v (a
// page pool; kv_tok is then the slot stride), else at row j.  Where the keys sit never changes the
// bits: a sequence's prompt attention is the same through a cache and through a page pool.
// key_first (no pages): row 0 of k / v holds position key_first (a sliding window that rolled);
// it may not exceed the first key a query sees.
void flash_attn_prefill(ThreadPool& pool, const float* q, size_t q_tok, size_t q_head, const float* k, const float* v,
                        size_t kv_head, size_t kv_tok, float* out, size_t o_tok, size_t o_head, int H, int Hkv, int T,
                        int D, int start, int window, float scale, bool bf16_pv, const int64_t* pages = nullptr,
                        int page_size = 0, int key_first = 0);

// Multi-head latent attention (DeepSeek-V2/V3, Kimi) in latent space, T query rows at positions
// start .. start + T - 1 over the latent keys 0 .. start + T - 1 (all of them: causal, no window):
// per head h, q = [q_nope[h] W_UK[h] | q_pe[h]], p = softmax over j of scale * q . [c_j | r_j],
// out[h] = (sum_j p_j c_j) W_UV[h]^T.  The absorptions are one fma chain per output in k order
// (flash::head_rows), the attention the prompt flash kernel with one kv head, keys of two parts
// (the latent c, kv_lora_rank wide, then the rope key r) and the latent as values; a one-row call
// (a decode step) takes the decode step's chunks, in parallel, merged in order.  So a row gives
// the same bits whatever T, the chunk it came in, the thread count, and whether its keys sit in a
// cache or a page pool (pages: a block table over latent / rope_key slots).  Strides in floats.
struct MlaArgs {
  const float* q_nope;  // [T][H][nope] at (q_tok, q_head) strides
  size_t qn_tok, qn_head;
  const float* q_pe;  // [T][H][R]
  size_t qp_tok, qp_head;
  const float* latent;  // key j's latent at slot(j) * lat_tok, C floats
  size_t lat_tok;
  const float* rope_key;  // key j's rope key at slot(j) * rk_tok, R floats
  size_t rk_tok;
  const float* w_uk;    // [H][nope][C] contiguous
  const float* w_uv_t;  // [H][C][v] contiguous
  float* out;           // [T][H][v] at (o_tok, o_head) strides
  size_t o_tok, o_head;
  int T, H, nope, C, R, v, start;
  float scale;
  const int64_t* pages;  // null: key j at slot j
  int page_size;
};
// Whether the tier in force runs mla_attention for latent width C and rope width R.
bool mla_attention_supported(int C, int R);
void mla_attention(ThreadPool& pool, const MlaArgs& m);

struct FlashArgs;
// Whether the decode step reads head size D with the prompt kernel's arithmetic (flash_decode_chunk).
bool flash_decode_supported(int D);
// One decode row (a.T == 1: its query at position a.start, keys from max(0, start - window + 1);
// a.out unused) over the keys of chunk [c0, c0 + kChunk) (flash_attn_impl.h), kv head g: the
// group's unnormalised O, max and sum per head into part [H / Hkv][D + 2], bit for bit what the
// prompt kernel (same tier, same bf16_pv) computes for that row over that chunk; the partials of a
// row's chunks folded in order by merge_chunk and finish_row give the prompt kernel's output.
void flash_decode_chunk(const FlashArgs& a, int g, int c0, bool bf16_pv, float* part);

}  // namespace kt
