// One routed-experts MoE layer on the CPU:  out[t] = sum_j w[t,j] * down_e(act(gate_e x) * up_e x),
// e = ids[t,j].  Weights use the stacked GGUF layout gate/up [E, I, H], down [E, H, I].
#pragma once
#include <cstdint>
#include <vector>

#include "thread_pool.h"
#include "weights.h"

namespace kt {

// 2 = gpt-oss (alpha, limit); 3 = DeepSeek-V4: silu(min(g, limit)) * clamp(u, +-limit)
enum class Activation : int { SiLU = 0, GeluTanh = 1, ClampSwiGLU = 2, ClampSiLU = 3 };
enum class DType : int { F32 = 0, BF16 = 1 };

struct MoEConfig {
  int num_experts = 0, hidden = 0, intermediate = 0;
  Backend backend = Backend::Llamafile;
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
  int gate_type = 0, up_type = 0, down_type = 0;
  Activation act = Activation::SiLU;
  float alpha = 1.702f, limit = 7.0f;
  // Optional per-expert biases (gpt-oss), fp32 [E, I], [E, I], [E, H]; null: none.  Gate/up
  // biases are added before the activation, the down bias before the routing weight.
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;
  // Packed backends: a packed copy made earlier (packed_data() of a MoE of the same config, e.g. a
  // mapped cache file of packed_bytes() bytes, 64-aligned) used in place instead of packing; it
  // must outlive the object.  Null: pack from gate / up / down.
  const uint8_t* prepacked = nullptr;
};

class MoE {
 public:
  // Validates shapes/types; for the AMX* backends requantises all experts in parallel on `pool`
  // into one allocation.  Llamafile weights are used in place and must outlive the object.
  MoE(const MoEConfig& cfg, ThreadPool& pool);
  // T tokens, k experts per token.  ids[T*k] int64 (negative = skip this slot), w[T*k] fp32,
  // x[T*hidden] in xdt, out[T*hidden] in odt.  Throws std::out_of_range for ids >= num_experts.
  void forward(ThreadPool& pool, int T, int k, const void* x, DType xdt, const int64_t* ids, const float* w,
               void* out, DType odt);
  const MoEConfig& config() const { return cfg_; }
  size_t packed_bytes() const { return packed_size_; }
  // The packed copy (gate, up, down back to back; what `prepacked` takes); null for Llamafile.
  const uint8_t* packed_data() const { return packed_ptr_; }
  // The weights as the kernels read them (0 gate, 1 up, 2 down): the training path shares them.
  const ProjWeights& proj(int i) const { return i == 0 ? gate_ : (i == 1 ? up_ : down_); }

 private:
  MoEConfig cfg_;
  ProjWeights gate_, up_, down_;
  AlignedBuf packed_;
  const uint8_t* packed_ptr_ = nullptr;
  size_t packed_size_ = 0;
  // forward scratch (grow-only; the activation-sized buffers are the pool's, pool_scratch)
  std::vector<int> counts_, offsets_, pair_tok_, pair_of_, tasks_;
  std::vector<AlignedBuf> thr_;  // per pool thread: gate/up tiles + dequant scratch
  struct Task { int e, r0, t0; };
  std::vector<Task> task_list_;
};

}  // namespace kt
