#include "weights.h"

#include "ggml_blocks.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kt {

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::Llamafile: return "llamafile";
    case Backend::AMXInt8: return "AMXInt8";
    case Backend::AMXBF16: return "AMXBF16";
    case Backend::AMXInt4: return "AMXInt4";
    case Backend::AMXInt4_1: return "AMXInt4_1";
    case Backend::LlamafilePanels: return "llamafile_panels";
  }
  return "?";
}

AlignedBuf::~AlignedBuf() { std::free(p_); }

AlignedBuf& pool_scratch(ThreadPool& pool, ScratchSlot slot) {
  static std::mutex mu;
  static std::map<const ThreadPool*, std::unique_ptr<AlignedBuf[]>> arenas;
  std::lock_guard<std::mutex> lk(mu);
  std::unique_ptr<AlignedBuf[]>& a = arenas[&pool];
  if (!a) a.reset(new AlignedBuf[kNumScratch]);
  return a[slot];
}

void* AlignedBuf::ensure(size_t bytes) {
  if (bytes <= n_ && p_) return p_;
  std::free(p_);
  p_ = nullptr;
  n_ = 0;
  size_t sz = ((bytes ? bytes : 64) + 63) & ~size_t(63);
  // Packed weights are streamed once per token: on 2 MiB pages a decode step takes a TLB miss
  // per 2 MiB instead of per 4 KiB (transparent huge pages are often opt-in, "madvise").
  constexpr size_t kHuge = size_t(2) << 20;
  const bool huge = sz >= 4 * kHuge;
  if (huge) sz = (sz + kHuge - 1) & ~(kHuge - 1);
  void* q = std::aligned_alloc(huge ? kHuge : 64, sz);
  if (!q) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (huge) madvise(q, sz, MADV_HUGEPAGE);  // advice only: no huge pages is not an error
#endif
  p_ = q;
  n_ = sz;
  return p_;
}

static int round_up(int x, int m) { return (x + m - 1) / m * m; }

// fp32 -> IEEE fp16, round to nearest even (the int4 group scales and mins).
static uint16_t f32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7fffffff;
  if (x >= 0x7f800000) return sign | 0x7c00 | (x > 0x7f800000 ? 0x200 : 0);
  if (x >= 0x477ff000) return sign | 0x7c00;  // >= 65520 rounds to inf
  if (x < 0x38800000) {                       // below 2^-14: fp16 subnormal (or zero)
    float a;
    std::memcpy(&a, &x, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));
  }
  return sign | static_cast<uint16_t>((x + 0xfff + ((x >> 13) & 1) - 0x38000000) >> 13);
}

// One 16-row panel of fp32 weights w[16][Kpad] -> the packed int4 layout (kernels.h).  The
// quantisation uses the fp16-rounded scale / min it stores, so dequantised weights are exactly
// d * (q - 8) (symmetric: the largest-magnitude value maps to -8, as Q4_0) or d * q + m
// (asymmetric: m = group min, d = (max - min) / 15, as Q4_1).
static void pack_i4_panel(const float* w, int Kpad, bool with_min, uint8_t* P) {
  uint16_t* D = reinterpret_cast<uint16_t*>(P + 8 * static_cast<size_t>(Kpad));
  uint16_t* M = D + Kpad / 2;
  std::memset(P, 0, 8 * static_cast<size_t>(Kpad));
  for (int grp = 0; grp < Kpad / kI4Group; ++grp)
    for (int r = 0; r < kPanelRows; ++r) {
      const float* wr = w + static_cast<size_t>(r) * Kpad + grp * kI4Group;
      float lo = wr[0], hi = wr[0], big = wr[0];
      for (int k = 1; k < kI4Group; ++k) {
        lo = std::min(lo, wr[k]);
        hi = std::max(hi, wr[k]);
        if (std::fabs(wr[k]) > std::fabs(big)) big = wr[k];
      }
      const uint16_t d16 = f32_to_fp16(with_min ? (hi - lo) / 15.f : big / -8.f);
      const uint16_t m16 = with_min ? f32_to_fp16(lo) : 0;
      const float d = fp16_to_f32(d16), m = fp16_to_f32(m16);
      const float id = d != 0.f ? 1.f / d : 0.f;
      D[grp * kPanelRows + r] = d16;
      if (with_min) M[grp * kPanelRows + r] = m16;
      for (int k = 0; k < kI4Group; ++k) {
        int q = static_cast<int>(std::nearbyint(with_min ? (wr[k] - m) * id : wr[k] * id)) + (with_min ? 0 : 8);
        q = q < 0 ? 0 : (q > 15 ? 15 : q);
        const int h = k / 8, j = k % 4, shift = (k % 8) < 4 ? 0 : 4;
        P[grp * 256 + 64 * h + 4 * r + j] |= static_cast<uint8_t>(q << shift);
      }
    }
}

// Rows r0 .. r0+15 of a Q4_K matrix (rows past `rows`: zeros) into one panel of kernels.h's
// llamafile_panels layout: the same integers and fp16 scales, moved.
static void pack_q4k_panel(const uint8_t* mat, size_t row_bytes, int r0, int rows, int cols, uint8_t* P) {
  const int nb = cols / QK_K;
  std::memset(P, 0, static_cast<size_t>(nb) * kQ4KPanelBlock);
  for (int r = 0; r < kPanelRows && r0 + r < rows; ++r) {
    const block_q4_K* x = reinterpret_cast<const block_q4_K*>(mat + static_cast<size_t>(r0 + r) * row_bytes);
    for (int i = 0; i < nb; ++i) {
      uint8_t* B = P + static_cast<size_t>(i) * kQ4KPanelBlock;
      const uint8_t* q = x[i].scales;
      for (int j = 0; j < 8; ++j) {  // ggml's 6-bit scale / min unpacking
        const uint8_t sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        const uint8_t m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        B[2048 + 16 * j + r] = sc;
        B[2048 + 128 + 16 * j + r] = m;
      }
      std::memcpy(B + 2048 + 256 + 2 * r, &x[i].d, 2);
      std::memcpy(B + 2048 + 288 + 2 * r, &x[i].dmin, 2);
      for (int g = 0; g < 4; ++g)
        for (int qd = 0; qd < 8; ++qd) std::memcpy(B + 64 * (8 * g + qd) + 4 * r, x[i].qs + 32 * g + 4 * qd, 4);
    }
  }
}

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
  if (b == Backend::LlamafilePanels && !(src_type == GGML_Q4_K && kt.panels_q4k)) b = p.backend = Backend::Llamafile;
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
  } else if (b == Backend::AMXInt4 || b == Backend::AMXInt4_1) {
    const bool with_min = b == Backend::AMXInt4_1;
    p.Kpad = round_up(cols, kI4Group);
    p.rows_pad = round_up(rows, kPanelRows);
    p.mat_bytes = static_cast<size_t>(p.rows_pad / kPanelRows) * i4_panel_bytes(p.Kpad, with_min);
    p.act = kt.packed_i4_act;
    p.gemm = with_min ? kt.packed_i4_1 : kt.packed_i4;
  } else if (b == Backend::LlamafilePanels) {
    p.Kpad = cols;
    p.rows_pad = round_up(rows, kPanelRows);
    p.mat_bytes = static_cast<size_t>(p.rows_pad / kPanelRows) * q4k_panel_bytes(cols);
    p.act = ActFmt::Q8_256;
    p.gemm = kt.panels_q4k;
  } else if (b == Backend::AMXBF16) {
    p.Kpad = round_up(cols, kBf16KAlign);
    p.rows_pad = round_up(rows, kPanelRows);
    p.mat_bytes = static_cast<size_t>(p.rows_pad) * p.Kpad * 2;
    p.act = kt.packed_bf16_act;
    p.gemm = kt.packed_bf16;
  } else {
    throw std::invalid_argument(what + ": unknown backend " + std::to_string(static_cast<int>(b)));
  }
  if (!p.gemm) throw std::invalid_argument(what + ": no " + backend_name(b) + " kernel on this ISA tier");
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
  const bool i4 = p.backend == Backend::AMXInt4 || p.backend == Backend::AMXInt4_1;
  const size_t panel_bytes = p.mat_bytes / panels;
  float* scales = i8 ? reinterpret_cast<float*>(dst + p.mat_bytes * p.count) : nullptr;
  int32_t* corr = i8 ? reinterpret_cast<int32_t*>(scales + static_cast<size_t>(p.rows_pad) * p.count) : nullptr;
  const int ng = p.Kpad / kI8Group;
  const uint8_t* s = static_cast<const uint8_t*>(src);
  if (p.backend == Backend::LlamafilePanels) {
    pool.parallel_for(ntasks, [&](int task, int) {
      const int e = task / panels, pn = task % panels;
      pack_q4k_panel(s + e * (p.row_bytes * p.rows), p.row_bytes, pn * kPanelRows, p.rows, p.cols,
                     dst + e * p.mat_bytes + static_cast<size_t>(pn) * panel_bytes);
    });
    adopt_packed(p, dst);
    return;
  }
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
    uint8_t* P = dst + e * p.mat_bytes + static_cast<size_t>(pn) * panel_bytes;
    if (i4) {
      pack_i4_panel(w.data(), p.Kpad, p.backend == Backend::AMXInt4_1, P);
    } else if (i8) {
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
  adopt_packed(p, dst);
}

void adopt_packed(ProjWeights& p, const uint8_t* dst) {
  if (p.backend == Backend::Llamafile) return;
  const bool i8 = p.backend == Backend::AMXInt8;
  const float* scales = i8 ? reinterpret_cast<const float*>(dst + p.mat_bytes * p.count) : nullptr;
  p.base = dst;
  p.scales = scales;
  p.corr = i8 ? reinterpret_cast<const int32_t*>(scales + static_cast<size_t>(p.rows_pad) * p.count) : nullptr;
}

uint64_t checksum_bytes(const uint8_t* data, size_t n, ThreadPool& pool) {
  // 1 MiB chunks hashed independently (8 xxh32-style lanes each), folded in order: the same value
  // for any thread count, at memory speed
  constexpr size_t kChunk = size_t(1) << 20;
  const size_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<uint64_t> h(chunks);
  pool.parallel_for(static_cast<int>(chunks), [&](int c, int) {
    const uint8_t* p = data + static_cast<size_t>(c) * kChunk;
    const size_t len = std::min(kChunk, n - static_cast<size_t>(c) * kChunk);
    uint32_t acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = 0x9E3779B1u * static_cast<uint32_t>(l + 1) + static_cast<uint32_t>(c);
    size_t i = 0;
    for (; i + 32 <= len; i += 32)
      for (int l = 0; l < 8; ++l) {
        uint32_t w;
        std::memcpy(&w, p + i + 4 * l, 4);
        uint32_t a = acc[l] + w * 0x85EBCA77u;
        a = (a << 13) | (a >> 19);
        acc[l] = a * 0x9E3779B1u;
      }
    uint64_t x = 0xCBF29CE484222325ull ^ len;
    for (int l = 0; l < 8; ++l) x = (x ^ acc[l]) * 0x100000001B3ull;
    for (; i < len; ++i) x = (x ^ p[i]) * 0x100000001B3ull;
    h[c] = x;
  });
  uint64_t x = 0xCBF29CE484222325ull ^ n;
  for (uint64_t v : h) x = (x ^ v) * 0x100000001B3ull + (x >> 29);
  return x;
}

}  // namespace kt
