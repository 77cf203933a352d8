#include "weights.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <vector>

namespace kt {

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::Llamafile: return "llamafile";
    case Backend::AMXInt8: return "AMXInt8";
    case Backend::AMXBF16: return "AMXBF16";
  }
  return "?";
}

AlignedBuf::~AlignedBuf() { std::free(p_); }

void* AlignedBuf::ensure(size_t bytes) {
  if (bytes <= n_ && p_) return p_;
  std::free(p_);
  p_ = nullptr;
  n_ = 0;
  const size_t sz = ((bytes ? bytes : 64) + 63) & ~size_t(63);
  void* q = std::aligned_alloc(64, sz);
  if (!q) throw std::bad_alloc();
  p_ = q;
  n_ = sz;
  return p_;
}

static int round_up(int x, int m) { return (x + m - 1) / m * m; }

ProjWeights describe_weights(Backend b, const void* src, int src_type, int count, int rows, int cols,
                             const std::string& what) {
  if (!src) throw std::invalid_argument(what + ": weight pointer is null");
  if (count <= 0 || rows <= 0 || cols <= 0)
    throw std::invalid_argument(what + ": shape must be positive, got [" + std::to_string(count) + ", " +
                                std::to_string(rows) + ", " + std::to_string(cols) + "]");
  check_row_len(src_type, cols, what);
  const KernelTable& kt = kernels();
  ProjWeights p;
  p.backend = b;
  p.src_type = src_type;
  p.count = count;
  p.rows = rows;
  p.cols = cols;
  p.row_bytes = row_bytes(src_type, cols);
  if (b == Backend::Llamafile) {
    if (!kt.lf_gemm[src_type]) throw std::invalid_argument(what + ": no llamafile kernel for " + type_info(src_type).name);
    p.Kpad = cols;
    p.rows_pad = rows;
    p.base = static_cast<const uint8_t*>(src);
    p.mat_bytes = p.row_bytes * rows;
    p.act = kt.lf_act[src_type];
    p.gemm = kt.lf_gemm[src_type];
  } else if (b == Backend::AMXInt8) {
    p.Kpad = round_up(cols, kI8Group);
    p.rows_pad = round_up(rows, kPanelRows);
    p.mat_bytes = static_cast<size_t>(p.rows_pad) * p.Kpad;
    p.act = kt.packed_i8_act;
    p.gemm = kt.packed_i8;
  } else {
    p.Kpad = round_up(cols, kBf16KAlign);
    p.rows_pad = round_up(rows, kPanelRows);
    p.mat_bytes = static_cast<size_t>(p.rows_pad) * p.Kpad * 2;
    p.act = kt.packed_bf16_act;
    p.gemm = kt.packed_bf16;
  }
  return p;
}

size_t packed_bytes(const ProjWeights& p) {
  if (p.backend == Backend::Llamafile) return 0;
  size_t b = p.mat_bytes * p.count;
  if (p.backend == Backend::AMXInt8) {
    b += sizeof(float) * p.rows_pad * static_cast<size_t>(p.count);
    b += sizeof(int32_t) * p.rows_pad * static_cast<size_t>(p.count) * (p.Kpad / kI8Group);
  }
  return (b + 63) & ~size_t(63);
}

void ProjWeights::setup(GemmArgs& g, int e, int r0, int nr) const {
  g.K = cols;
  g.Kpad = Kpad;
  g.nr = nr;
  g.nr_avail = rows_pad - r0;
  if (backend == Backend::Llamafile) {
    g.W = base + e * mat_bytes + static_cast<size_t>(r0) * row_bytes;
    g.w_row_bytes = row_bytes;
  } else {
    const size_t panel = mat_bytes / (rows_pad / kPanelRows);
    g.W = base + e * mat_bytes + static_cast<size_t>(r0 / kPanelRows) * panel;
    g.w_scale = scales ? scales + static_cast<size_t>(e) * rows_pad + r0 : nullptr;
    g.w_corr = corr ? corr + (static_cast<size_t>(e) * rows_pad + r0) * (Kpad / kI8Group) : nullptr;
  }
}

void pack_weights(ProjWeights& p, const void* src, uint8_t* dst, ThreadPool& pool) {
  if (p.backend == Backend::Llamafile) return;
  const KernelTable& kt = kernels();
  const int panels = p.rows_pad / kPanelRows;
  const int ntasks = p.count * panels;
  const bool i8 = p.backend == Backend::AMXInt8;
  float* scales = i8 ? reinterpret_cast<float*>(dst + p.mat_bytes * p.count) : nullptr;
  int32_t* corr = i8 ? reinterpret_cast<int32_t*>(scales + static_cast<size_t>(p.rows_pad) * p.count) : nullptr;
  const int ng = p.Kpad / kI8Group;
  const uint8_t* s = static_cast<const uint8_t*>(src);
  std::vector<std::vector<float>> scratch(pool.size());
  pool.parallel_for(ntasks, [&](int task, int tid) {
    const int e = task / panels, pn = task % panels;
    std::vector<float>& w = scratch[tid];
    w.assign(static_cast<size_t>(kPanelRows) * p.Kpad, 0.f);
    for (int r = 0; r < kPanelRows; ++r) {
      const int row = pn * kPanelRows + r;
      if (row < p.rows)
        kt.dequant_row(p.src_type, s + e * (p.row_bytes * p.rows) + row * p.row_bytes, &w[static_cast<size_t>(r) * p.Kpad], p.cols);
    }
    uint8_t* P = dst + e * p.mat_bytes + static_cast<size_t>(pn) * kPanelRows * p.Kpad * (i8 ? 1 : 2);
    if (i8) {
      float inv[kPanelRows];
      for (int r = 0; r < kPanelRows; ++r) {
        float amax = 0.f;
        const float* wr = &w[static_cast<size_t>(r) * p.Kpad];
        for (int k = 0; k < p.Kpad; ++k) {
          const float v = std::fabs(wr[k]);
          amax = v > amax ? v : amax;
        }
        scales[static_cast<size_t>(e) * p.rows_pad + pn * kPanelRows + r] = amax / 127.f;
        inv[r] = amax > 0.f ? 127.f / amax : 0.f;
      }
      int32_t* cr = corr + (static_cast<size_t>(e) * p.rows_pad + pn * kPanelRows) * ng;  // [ng][16]
      for (int i = 0; i < ng * kPanelRows; ++i) cr[i] = 0;
      for (int kq = 0; kq < p.Kpad / 4; ++kq)
        for (int r = 0; r < kPanelRows; ++r)
          for (int j = 0; j < 4; ++j) {
            const float v = w[static_cast<size_t>(r) * p.Kpad + 4 * kq + j] * inv[r];
            int q = static_cast<int>(std::nearbyint(v));
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            P[64 * static_cast<size_t>(kq) + 4 * r + j] = static_cast<uint8_t>(static_cast<int8_t>(q));
            cr[(4 * kq / kI8Group) * kPanelRows + r] -= 128 * q;
          }
    } else {
      uint16_t* Q = reinterpret_cast<uint16_t*>(P);
      for (int kp = 0; kp < p.Kpad / 2; ++kp)
        for (int r = 0; r < kPanelRows; ++r)
          for (int j = 0; j < 2; ++j)
            Q[32 * static_cast<size_t>(kp) + 2 * r + j] = f32_to_bf16(w[static_cast<size_t>(r) * p.Kpad + 2 * kp + j]);
    }
  });
  p.base = dst;
  p.scales = scales;
  p.corr = corr;
}

}  // namespace kt
