#include "linear.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kt {

Linear::Linear(int in_features, int out_features, Backend backend, const void* weight, int weight_type, ThreadPool& pool) {
  w_ = describe_weights(backend, weight, weight_type, 1, out_features, in_features,
                        "weight [" + std::to_string(out_features) + ", " + std::to_string(in_features) + "]");
  if (backend != Backend::Llamafile) {
    uint8_t* base = static_cast<uint8_t*>(packed_.ensure(packed_bytes(w_)));
    pack_weights(w_, weight, base, pool);
  }
}

void Linear::forward(ThreadPool& pool, int T, const void* x, DType xdt, void* out, DType odt) {
  if (T < 0) throw std::invalid_argument("Linear.forward: T must be >= 0");
  if (T == 0) return;
  const KernelTable& kt = kernels();
  const int K = w_.cols, N = w_.rows, nth = pool.size();
  constexpr int kTB = 256;  // tokens per task: the prefill paths unpack a row block once per task
  const size_t tmp_bytes = std::max(sizeof(float) * (2 * static_cast<size_t>(w_.Kpad) + 128), kGemmPrefillTmp(w_.Kpad));
  if (static_cast<int>(thr_.size()) < nth) thr_ = std::vector<AlignedBuf>(nth);
  for (int i = 0; i < nth; ++i) thr_[i].ensure(tmp_bytes);
  const size_t sa = act_row_bytes(w_.act, w_.Kpad);
  uint8_t* xa = static_cast<uint8_t*>(xa_.ensure(sa * T));
  const int chunk = 8;
  pool.parallel_for((T + chunk - 1) / chunk, [&](int task, int tid) {
    float* xf = static_cast<float*>(thr_[tid].data()) + w_.Kpad + 64;
    for (int t = task * chunk; t < std::min(T, (task + 1) * chunk); ++t) {
      const float* xr = static_cast<const float*>(x) + static_cast<size_t>(t) * K;
      if (xdt == DType::BF16) {
        kt.bf16_to_f32_row(static_cast<const uint16_t*>(x) + static_cast<size_t>(t) * K, xf, K);
        xr = xf;
      }
      kt.quantize_act(w_.act, xr, K, w_.Kpad, xa + sa * t);
    }
  });
  float* y = odt == DType::F32 ? static_cast<float*>(out)
                               : static_cast<float*>(ybuf_.ensure(sizeof(float) * static_cast<size_t>(T) * N));
  int rb = 64;
  const int ntb = (T + kTB - 1) / kTB;
  while (rb > (T >= 8 ? 32 : 16) && static_cast<long>(ntb) * ((N + rb - 1) / rb) < 8L * nth) rb /= 2;
  const int nrb = (N + rb - 1) / rb;
  pool.parallel_for(nrb * ntb, [&](int task, int tid) {
    const int r0 = (task % nrb) * rb, t0 = (task / nrb) * kTB;
    const int nt = std::min(kTB, T - t0), nr = std::min(rb, N - r0);
    const uint8_t* A[kTB];
    for (int t = 0; t < nt; ++t) A[t] = xa + sa * (t0 + t);
    GemmArgs g;
    g.A = A; g.nt = nt; g.C = y + static_cast<size_t>(t0) * N + r0; g.ldc = N;
    g.tmp = static_cast<float*>(thr_[tid].data());
    g.tmp_bytes = tmp_bytes;
    w_.setup(g, 0, r0, nr);
    w_.gemm(g);
  });
  if (odt == DType::BF16) {
    pool.parallel_for((T + chunk - 1) / chunk, [&](int task, int) {
      for (int t = task * chunk; t < std::min(T, (task + 1) * chunk); ++t)
        kt.f32_to_bf16_row(y + static_cast<size_t>(t) * N, static_cast<uint16_t*>(out) + static_cast<size_t>(t) * N, N);
    });
  }
}

}  // namespace kt
