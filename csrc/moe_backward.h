// Training path of one routed-experts MoE layer on the CPU: forward with per-expert LoRA and
// its backward, on the frozen base weights of an existing MoE (shared, read in place).
//
// Per (token t, slot j) with expert e = ids[t,j] and weight w = w[t,j]:
//   a  = A_gu[e] x                          [r_gu]      (gate and up share A: fused gate_up LoRA)
//   gu = W_gu[e] x + s_gu * B_gu[e] a         [2I]        (rows [0, I) gate, [I, 2I) up)
//   h  = act(g) * u                           [I]
//   y  = W_d[e] h + s_d * B_d[e] (A_d[e] h)   [H]
//   out[t] += w * y
// LoRA tensors are fp32, contiguous: A_gu [E, r_gu, H], B_gu [E, 2I, r_gu], A_d [E, r_d, I],
// B_d [E, H, r_d]; a null A means no LoRA on that projection.
//
// The backward gives d x, d w and the four LoRA gradients.  Products with the transposed base
// weights (W^T g) take a column slice of the weight (of gate and up stacked, for d x) per task,
// dequantised 16 rows at a time and repacked as a bf16 matrix of the slice's columns, and run
// the tier's packed-bf16 GEMM on it (AMX tiles where present); fp32 / fp16 weights keep an exact
// fp32 product.  No full copy of a base weight is ever made.  Saved activations: the pre-activations gu per
// (token, slot), T*k*2I floats, or nothing when the backward recomputes them.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "moe.h"

namespace kt {

struct LoraArgs {
  const float* A_gu = nullptr;
  const float* B_gu = nullptr;
  int r_gu = 0;
  float s_gu = 0.f;
  const float* A_d = nullptr;
  const float* B_d = nullptr;
  int r_d = 0;
  float s_d = 0.f;
};

struct LoraGrads {  // same shapes as LoraArgs; overwritten (experts no token reached get zeros)
  float* A_gu = nullptr;
  float* B_gu = nullptr;
  float* A_d = nullptr;
  float* B_d = nullptr;
};

class MoETrain {
 public:
  explicit MoETrain(std::shared_ptr<MoE> base);
  // x [T, H], ids/w [T, k] (negative id = empty slot), out [T, H] fp32.  save_gu: null, or
  // [T*k, 2I] floats receiving the pre-activations for backward.
  void forward(ThreadPool& pool, int T, int k, const float* x, const int64_t* ids, const float* w, const LoraArgs& lora,
               float* out, float* save_gu);
  // dout [T, H] -> dx [T, H], dw [T, k] (0 for empty slots), LoRA grads.  saved_gu: what
  // forward saved, or null to recompute it.
  void backward(ThreadPool& pool, int T, int k, const float* x, const int64_t* ids, const float* w,
                const LoraArgs& lora, const float* saved_gu, const float* dout, float* dx, float* dw,
                const LoraGrads& grads);
  // Bytes of the call scratch shared by all layers (grown to the largest call so far).
  static size_t scratch_bytes();

 private:
  struct Routing {
    std::vector<int> counts, offsets;
    std::vector<int> pair_slot, pair_exp;  // pair p (sorted by expert) -> t*k + j, expert
    int P = 0, k = 1;
  };
  void route(int T, int k, const int64_t* ids, Routing& r) const;
  void check_lora(const LoraArgs& l) const;
  // a_gu [P, r_gu] (when LoRA) and the pre-activations into gu [T*k, 2I] (when gu != null).
  void gate_up(ThreadPool& pool, const Routing& rt, int T, const float* x, const LoraArgs& l, float* a_gu, float* gu);
  // Pair p's row h[p] = act(g) * u from its pre-activations in gu and, with LoRA on down, its
  // LoRA-A product a_d[p] = A_d[expert] h[p] (when a_d != null); returns h[p].
  const float* glu_row(const KernelTable& kt, const Routing& rt, int p, const float* gu, const LoraArgs& l, float* h,
                       float* a_d) const;
  // Scratch of one call, shared by every layer (they run one at a time; the mutex makes sure):
  // the memory is that of the largest call, not one copy per layer.
  struct Scratch {
    std::mutex mu;
    AlignedBuf xg, xu, gu, h, hq, y, a_gu, a_d, bd, b_gu, g1, ta;
    std::vector<AlignedBuf> thr, tpack;  // tpack: transposed weight slices (packed bf16) per thread
  };
  static Scratch& shared_scratch();
  float* thread_buf(int tid) { return static_cast<float*>(s_.thr[tid].data()); }

  std::shared_ptr<MoE> base_;
  int E_, H_, I_;
  Activation act_;
  float alpha_, limit_;
  Routing rt_;
  Scratch& s_;
  size_t thr_floats_ = 0;
};

}  // namespace kt
