// Dense linear layer on the CPU: y[T, out] = x[T, in] @ W^T, W [out, in] in any llamafile type
// (or requantised for the AMXInt8 / AMXBF16 backends).
#pragma once
#include <memory>
#include <vector>

#include "moe.h"

namespace kt {

class Linear {
 public:
  Linear(int in_features, int out_features, Backend backend, const void* weight, int weight_type, ThreadPool& pool);
  void forward(ThreadPool& pool, int T, const void* x, DType xdt, void* out, DType odt);
  int in_features() const { return w_.cols; }
  int out_features() const { return w_.rows; }
  const ProjWeights& weights() const { return w_; }

 private:
  ProjWeights w_;
  AlignedBuf packed_;  // activation-sized scratch: pool_scratch
  std::vector<AlignedBuf> thr_;
};

// Linears that read the same input (q/k/v, gate/up): the input is quantised once per activation
// format and the row blocks of every member run in one parallel_for, so a decode step pays one
// pool wake-up and one quantisation instead of one per matrix.  Outputs are written side by side,
// out[t] = [y_0[t] | y_1[t] | ...]; with `glu` >= 0 (an Activation) the group must be two equally
// sized members (gate, up) and out[t] = act(gate[t]) * up[t] instead.  The members' weights stay
// where they are (the group holds the Linears).
class LinearGroup {
 public:
  LinearGroup(std::vector<std::shared_ptr<Linear>> parts, int glu);
  void forward(ThreadPool& pool, int T, const float* x, float* out);
  int in_features() const { return K_; }
  int out_features() const { return glu_ >= 0 ? total_ / 2 : total_; }

 private:
  struct Task { int part, r0, nr; };
  std::vector<std::shared_ptr<Linear>> parts_;
  std::vector<int> offset_;   // first output column of each member
  std::vector<int> act_slot_; // which quantised copy of x each member reads
  std::vector<std::pair<ActFmt, int>> acts_;  // (format, Kpad) of each quantised copy
  std::vector<Task> tasks_;
  int tasks_nth_ = -1, tasks_tclass_ = -1;
  int K_ = 0, total_ = 0, glu_ = -1;
  size_t tmp_bytes_ = 0;
  std::vector<AlignedBuf> thr_;
};

}  // namespace kt
