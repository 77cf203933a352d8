// Dense linear layer on the CPU: y[T, out] = x[T, in] @ W^T, W [out, in] in any llamafile type
// (or requantised for the AMXInt8 / AMXBF16 backends).
#pragma once
#include <vector>

#include "moe.h"

namespace kt {

class Linear {
 public:
  Linear(int in_features, int out_features, Backend backend, const void* weight, int weight_type, ThreadPool& pool);
  void forward(ThreadPool& pool, int T, const void* x, DType xdt, void* out, DType odt);
  int in_features() const { return w_.cols; }
  int out_features() const { return w_.rows; }

 private:
  ProjWeights w_;
  AlignedBuf packed_, xa_, ybuf_;
  std::vector<AlignedBuf> thr_;
};

}  // namespace kt
