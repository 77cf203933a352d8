#include "moe_backward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kt {
namespace {

constexpr int kTokBlock = 64;   // pairs of one expert handled by one task
constexpr int kColBlock = 256;  // columns of one transposed-product task (a multiple of every block size)
constexpr int kTile = 64 * kTokBlock;
constexpr int kChunk = 8;       // pairs / tokens per element-wise task

float dotf(const float* a, const float* b, int n) {
  float s[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  float r = 0.f;
  for (; i < n; ++i) r += a[i] * b[i];
  return r + ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

void axpy_small(float a, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

int row_block(int rows, int active_units, int threads) {
  int rb = 64;
  while (rb > 16 && static_cast<long>(active_units) * ((rows + rb - 1) / rb) < 8L * threads) rb /= 2;
  return rb;
}

int chunks(int n) { return (n + kChunk - 1) / kChunk; }

// dg = dh * u * act'(g), du = dh * act(g) for the gated activations of moe.h.
void glu_backward(Activation act, const float* g, const float* u, const float* dh, float* dg, float* du, int n,
                  float alpha, float limit) {
  if (act == Activation::SiLU) {
    for (int i = 0; i < n; ++i) {
      const float s = 1.f / (1.f + std::exp(-g[i]));
      dg[i] = dh[i] * u[i] * (s * (1.f + g[i] * (1.f - s)));
      du[i] = dh[i] * g[i] * s;
    }
  } else if (act == Activation::GeluTanh) {
    constexpr float c = 0.7978845608028654f, b = 0.044715f;
    for (int i = 0; i < n; ++i) {
      const float x = g[i];
      const float th = std::tanh(c * (x + b * x * x * x));
      const float a = 0.5f * x * (1.f + th);
      const float da = 0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * c * (1.f + 3.f * b * x * x);
      dg[i] = dh[i] * u[i] * da;
      du[i] = dh[i] * a;
    }
  } else if (act == Activation::ClampSiLU) {  // silu(gc) * clamp(u, +-limit), gc = min(g, limit)
    for (int i = 0; i < n; ++i) {
      const float gc = g[i] > limit ? limit : g[i];
      const float uc = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
      const float s = 1.f / (1.f + std::exp(-gc));
      dg[i] = g[i] > limit ? 0.f : dh[i] * uc * (s * (1.f + gc * (1.f - s)));
      du[i] = (u[i] > limit || u[i] < -limit) ? 0.f : dh[i] * gc * s;
    }
  } else {  // (clamp(u, +-limit) + 1) * gc * sigmoid(alpha * gc), gc = min(g, limit)
    for (int i = 0; i < n; ++i) {
      const float gc = g[i] > limit ? limit : g[i];
      const float uc = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
      const float s = 1.f / (1.f + std::exp(-alpha * gc));
      dg[i] = g[i] > limit ? 0.f : dh[i] * (uc + 1.f) * (s + gc * alpha * s * (1.f - s));
      du[i] = (u[i] > limit || u[i] < -limit) ? 0.f : dh[i] * gc * s;
    }
  }
}

// C[t][c] += sum_r coef[t][r] * W_e[r, c0 + c] for c < nc, t < nt: the fp32 transposed product
// of one column slice of matrix e, 16 rows at a time (slice_rows into buf, >= 16 * nc floats;
// fp32 rows are read in place).  The exact path for fp32 / fp16 weights (see gemm_transposed).
void transposed_product(const KernelTable& kt, const ProjWeights& p, int e, int c0, int nc, const float* const* coef,
                        float* const* C, int nt, float* buf);

// Rows [r0, r0 + nrow) (nrow <= 16, within one panel for the packed layouts) of matrix e,
// columns [c0, c0 + nc), dequantised to fp32: buf[r * nc + c].
void slice_rows(const KernelTable& kt, const ProjWeights& p, int e, int c0, int nc, int r0, int nrow, float* buf) {
  if (p.backend == Backend::Llamafile) {
    const TypeInfo& ti = type_info(p.src_type);
    const uint8_t* W = p.base + e * p.mat_bytes + static_cast<size_t>(c0 / ti.block_elems) * ti.block_bytes;
    for (int r = 0; r < nrow; ++r) kt.dequant_row(p.src_type, W + static_cast<size_t>(r0 + r) * p.row_bytes, buf + r * nc, nc);
    return;
  }
  const int panels = p.rows_pad / kPanelRows;
  const size_t panel_bytes = p.mat_bytes / panels;
  const int pn = r0 / kPanelRows, rr = r0 % kPanelRows;
  const uint8_t* P = p.base + e * p.mat_bytes + pn * panel_bytes;
  if (p.backend == Backend::AMXInt8) {  // int8 at P[64*(k/4) + 4*r + k%4], times the row scale
    const float* sc = p.scales + static_cast<size_t>(e) * p.rows_pad + r0;
    for (int c = 0; c < nc; ++c) {
      const int kk = c0 + c;
      const int8_t* q = reinterpret_cast<const int8_t*>(P + 64 * static_cast<size_t>(kk / 4) + kk % 4) + 4 * rr;
      for (int r = 0; r < nrow; ++r) buf[r * nc + c] = static_cast<float>(q[4 * r]) * sc[r];
    }
  } else {  // bf16 at Q[32*(k/2) + 2*r + k%2]
    const uint16_t* Q = reinterpret_cast<const uint16_t*>(P);
    for (int c = 0; c < nc; ++c) {
      const int kk = c0 + c;
      const uint16_t* q = Q + 32 * static_cast<size_t>(kk / 2) + kk % 2 + 2 * rr;
      for (int r = 0; r < nrow; ++r) buf[r * nc + c] = bf16_to_f32(q[2 * r]);
    }
  }
}

void transposed_product(const KernelTable& kt, const ProjWeights& p, int e, int c0, int nc, const float* const* coef,
                        float* const* C, int nt, float* buf) {
  const bool f32 = p.backend == Backend::Llamafile && p.src_type == GGML_F32;
  const uint8_t* W32 = f32 ? p.base + e * p.mat_bytes + 4 * static_cast<size_t>(c0) : nullptr;
  for (int r0 = 0; r0 < p.rows; r0 += kPanelRows) {
    const int nrow = std::min(kPanelRows, p.rows - r0);
    if (!f32) slice_rows(kt, p, e, c0, nc, r0, nrow, buf);
    for (int r = 0; r < nrow; ++r) {
      const float* wr = f32 ? reinterpret_cast<const float*>(W32 + static_cast<size_t>(r0 + r) * p.row_bytes) : buf + r * nc;
      for (int t = 0; t < nt; ++t) {
        const float a = coef[t][r0 + r];
        if (a != 0.f) kt.axpy(a, wr, C[t], nc);
      }
    }
  }
}

// The transposed product as one GEMM of the tier's packed-bf16 kernel (AMX tiles where present):
// columns [c0, c0 + nc) of the matrices in mats (their rows stacked: R rows in all) become a
// packed-bf16 matrix of nc rows x R (rounded to bf16: the weights of every backward type but
// fp32/fp16, which keep the exact product above), and C[t][c] = sum_r A_t[r] W[r][c0 + c] for the
// nt activation rows A (format kt.packed_bf16_act, R padded to Kpad) is written, not added.
struct TransposedGemm {
  const ProjWeights* mats[2];
  int nmat, R, Kpad;
};

void transposed_gemm(const KernelTable& kt, const TransposedGemm& tg, int e, int c0, int nc, const uint8_t* const* A,
                     int nt, float* C, size_t ldc, uint8_t* pack, float* buf) {
  const int npan = (nc + kPanelRows - 1) / kPanelRows;
  const size_t panel_units = static_cast<size_t>(kPanelRows) * (tg.Kpad / 2);  // u32 (bf16 pairs) per panel
  uint32_t* dst = reinterpret_cast<uint32_t*>(pack);
  if (nc % kPanelRows || tg.R % kBf16KAlign) std::memset(dst, 0, npan * panel_units * 4);
  uint16_t* b16 = reinterpret_cast<uint16_t*>(buf + kPanelRows * static_cast<size_t>(nc));
  uint32_t* units = reinterpret_cast<uint32_t*>(b16 + kPanelRows * static_cast<size_t>(nc));
  int rbase = 0;
  for (int m = 0; m < tg.nmat; ++m) {
    const ProjWeights& p = *tg.mats[m];
    for (int r0 = 0; r0 < p.rows; r0 += kPanelRows) {
      const int nrow = std::min(kPanelRows, p.rows - r0);
      slice_rows(kt, p, e, c0, nc, r0, nrow, buf);
      kt.f32_to_bf16_row(buf, b16, nrow * nc);
      for (int r = 0; r < nrow; r += 2) {  // rows r, r + 1 -> one k pair of every column
        const uint16_t* x0 = b16 + static_cast<size_t>(r) * nc;
        const uint16_t* x1 = r + 1 < nrow ? x0 + nc : nullptr;
        for (int c = 0; c < nc; ++c) units[c] = x0[c] | (x1 ? static_cast<uint32_t>(x1[c]) << 16 : 0u);
        const size_t kp = static_cast<size_t>(rbase + r0 + r) / 2;
        for (int pc = 0; pc < npan; ++pc)
          std::memcpy(dst + pc * panel_units + kp * kPanelRows, units + pc * kPanelRows,
                      4 * static_cast<size_t>(std::min(kPanelRows, nc - pc * kPanelRows)));
      }
    }
    rbase += p.rows;
  }
  GemmArgs g;
  g.K = tg.R;
  g.Kpad = tg.Kpad;
  g.W = pack;
  g.nr = nc;
  g.nr_avail = nc;
  g.A = A;
  g.nt = nt;
  g.C = C;
  g.ldc = ldc;
  g.tmp = buf;
  kt.packed_bf16(g);
}

// Whether the backward's transposed products go through transposed_gemm: every source but the
// fp32 / fp16 llamafile types (their product stays exact fp32).
bool gemm_transposed(const ProjWeights& p) {
  return p.backend != Backend::Llamafile || (p.src_type != GGML_F32 && p.src_type != GGML_F16);
}

// One task of a product over the experts: expert e's pairs t0 .. t0 + nt (p0 .. p0 + nt in the
// expert-sorted pair order) times its output rows (or columns) c0 .. c0 + nc.
struct Task { int e, c0, t0, nt, nc, p0; };

// The tasks of a product with `rows` outputs over the experts that `counts` pairs hit (their first
// pairs at `offsets`), in expert order, `block` outputs per task.
void expert_tasks(const std::vector<int>& counts, const std::vector<int>& offsets, int rows, int block,
                  std::vector<Task>& tasks) {
  tasks.clear();
  for (int e = 0; e < static_cast<int>(counts.size()); ++e)
    for (int t0 = 0; t0 < counts[e]; t0 += kTokBlock)
      for (int c0 = 0; c0 < rows; c0 += block)
        tasks.push_back({e, c0, t0, std::min(kTokBlock, counts[e] - t0), std::min(block, rows - c0), offsets[e] + t0});
}

// The same with the row block sized so the pool gets enough tasks.
std::vector<Task> row_tasks(const std::vector<int>& counts, const std::vector<int>& offsets, int rows, int threads) {
  int active = 0;
  for (int c : counts) active += c > 0;
  std::vector<Task> tasks;
  expert_tasks(counts, offsets, rows, row_block(rows, active, threads), tasks);
  return tasks;
}

// dst[t] = sum over token t's k slots of w[t, j] (1 when w is null) times src[its pair], each
// token's slots in slot order; `pair_slot` maps the P pairs (sorted by expert) to t * k + j.
void combine_slots(ThreadPool& pool, const KernelTable& kt, const std::vector<int>& pair_slot, int P, int T, int k,
                   int H, const float* w, const float* src, float* dst) {
  std::vector<int> pair_of(static_cast<size_t>(T) * k, -1);
  for (int p = 0; p < P; ++p) pair_of[pair_slot[p]] = p;
  pool.parallel_for(chunks(T), [&](int task, int) {
    for (int t = task * kChunk; t < std::min(T, (task + 1) * kChunk); ++t) {
      float* o = dst + static_cast<size_t>(t) * H;
      std::fill(o, o + H, 0.f);
      for (int j = 0; j < k; ++j) {
        const int p = pair_of[static_cast<size_t>(t) * k + j];
        if (p >= 0) kt.axpy(w ? w[static_cast<size_t>(t) * k + j] : 1.f, src + static_cast<size_t>(p) * H, o, H);
      }
    }
  });
}

}  // namespace

MoETrain::Scratch& MoETrain::shared_scratch() {
  static Scratch s;
  return s;
}

size_t MoETrain::scratch_bytes() {
  Scratch& s = shared_scratch();
  std::lock_guard<std::mutex> lock(s.mu);
  size_t n = 0;
  for (const AlignedBuf* b : {&s.xg, &s.xu, &s.gu, &s.h, &s.hq, &s.y, &s.a_gu, &s.a_d, &s.bd, &s.b_gu, &s.g1, &s.ta})
    n += b->size();
  for (const AlignedBuf& b : s.thr) n += b.size();
  for (const AlignedBuf& b : s.tpack) n += b.size();
  return n;
}

MoETrain::MoETrain(std::shared_ptr<MoE> base) : base_(std::move(base)), s_(shared_scratch()) {
  if (!base_) throw std::invalid_argument("MoETrain: base MoE is null");
  const MoEConfig& c = base_->config();
  if (c.backend == Backend::AMXInt4 || c.backend == Backend::AMXInt4_1)
    throw std::invalid_argument(std::string("MoETrain: backend ") + backend_name(c.backend) +
                                " has no backward; use llamafile, AMXInt8 or AMXBF16");
  E_ = c.num_experts;
  H_ = c.hidden;
  I_ = c.intermediate;
  act_ = c.act;
  alpha_ = c.alpha;
  limit_ = c.limit;
  int kmax = std::max(H_, I_);
  for (int i = 0; i < 3; ++i) kmax = std::max(kmax, base_->proj(i).Kpad);
  // gate + up tiles, then GEMM scratch (prefill paths enabled) / the transposed-product slice
  thr_floats_ = 2 * static_cast<size_t>(kTile) +
                std::max(kGemmPrefillTmp(kmax) / sizeof(float) + 16, static_cast<size_t>(kPanelRows) * kColBlock);
}

void MoETrain::check_lora(const LoraArgs& l) const {
  if ((l.A_gu == nullptr) != (l.B_gu == nullptr) || (l.A_d == nullptr) != (l.B_d == nullptr))
    throw std::invalid_argument("MoETrain: LoRA A and B must be given together");
  if ((l.A_gu && l.r_gu <= 0) || (l.A_d && l.r_d <= 0))
    throw std::invalid_argument("MoETrain: LoRA rank must be positive");
}

void MoETrain::route(int T, int k, const int64_t* ids, Routing& r) const {
  const int E = E_;
  r.k = k;
  r.counts.assign(E, 0);
  const int64_t n = static_cast<int64_t>(T) * k;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (id < 0) continue;
    if (id >= E)
      throw std::out_of_range("MoETrain: expert id " + std::to_string(id) + " at [" + std::to_string(i / k) + ", " +
                              std::to_string(i % k) + "] is >= num_experts " + std::to_string(E));
    r.counts[id]++;
  }
  r.offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) r.offsets[e + 1] = r.offsets[e] + r.counts[e];
  r.P = r.offsets[E];
  r.pair_slot.resize(std::max(r.P, 1));
  r.pair_exp.resize(std::max(r.P, 1));
  std::vector<int> cur(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (id < 0) continue;
    const int p = cur[id]++;
    r.pair_slot[p] = static_cast<int>(i);
    r.pair_exp[p] = static_cast<int>(id);
  }
}

void MoETrain::gate_up(ThreadPool& pool, const Routing& rt, int T, const float* x, const LoraArgs& l, float* a_gu,
                       float* gu) {
  const KernelTable& kt = kernels();
  const ProjWeights& pg = base_->proj(0);
  const ProjWeights& pu = base_->proj(1);
  const int H = H_, I = I_, P = rt.P, k = rt.k, rg = l.r_gu;
  const bool lora = l.A_gu != nullptr;
  if (lora) {
    pool.parallel_for(chunks(P), [&](int task, int) {
      for (int p = task * kChunk; p < std::min(P, (task + 1) * kChunk); ++p) {
        const float* xr = x + static_cast<size_t>(rt.pair_slot[p] / k) * H;
        const float* A = l.A_gu + static_cast<size_t>(rt.pair_exp[p]) * rg * H;
        for (int j = 0; j < rg; ++j) a_gu[static_cast<size_t>(p) * rg + j] = dotf(A + static_cast<size_t>(j) * H, xr, H);
      }
    });
  }
  if (!gu) return;
  const bool same = pg.act == pu.act && pg.Kpad == pu.Kpad;
  const size_t sg = act_row_bytes(pg.act, pg.Kpad), su = act_row_bytes(pu.act, pu.Kpad);
  uint8_t* xg = static_cast<uint8_t*>(s_.xg.ensure(sg * std::max(T, 1)));
  uint8_t* xu = same ? xg : static_cast<uint8_t*>(s_.xu.ensure(su * std::max(T, 1)));
  pool.parallel_for(chunks(T), [&](int task, int) {
    for (int t = task * kChunk; t < std::min(T, (task + 1) * kChunk); ++t) {
      kt.quantize_act(pg.act, x + static_cast<size_t>(t) * H, H, pg.Kpad, xg + sg * t);
      if (!same) kt.quantize_act(pu.act, x + static_cast<size_t>(t) * H, H, pu.Kpad, xu + su * t);
    }
  });
  const std::vector<Task> tasks = row_tasks(rt.counts, rt.offsets, I, pool.size());
  const size_t tmp_bytes = (thr_floats_ - 2 * kTile) * sizeof(float);
  pool.parallel_for(static_cast<int>(tasks.size()), [&](int ti, int tid) {
    const Task tk = tasks[ti];
    const int nt = tk.nt, nr = tk.nc, p0 = tk.p0;
    const uint8_t* Ag[kTokBlock];
    const uint8_t* Au[kTokBlock];
    for (int t = 0; t < nt; ++t) {
      const int tok = rt.pair_slot[p0 + t] / k;
      Ag[t] = xg + sg * tok;
      Au[t] = xu + su * tok;
    }
    float* G = thread_buf(tid);
    float* U = G + kTile;
    GemmArgs g;
    g.A = Ag; g.nt = nt; g.C = G; g.ldc = nr; g.tmp = U + kTile; g.tmp_bytes = tmp_bytes;
    pg.setup(g, tk.e, tk.c0, nr);
    pg.gemm(g);
    GemmArgs u;
    u.A = Au; u.nt = nt; u.C = U; u.ldc = nr; u.tmp = U + kTile; u.tmp_bytes = tmp_bytes;
    pu.setup(u, tk.e, tk.c0, nr);
    pu.gemm(u);
    const float* B = lora ? l.B_gu + static_cast<size_t>(tk.e) * 2 * I * rg : nullptr;
    for (int t = 0; t < nt; ++t) {
      const int p = p0 + t;
      float* dst = gu + static_cast<size_t>(rt.pair_slot[p]) * 2 * I;
      for (int rr = 0; rr < nr; ++rr) {
        float gv = G[t * nr + rr], uv = U[t * nr + rr];
        if (lora) {
          const float* ap = a_gu + static_cast<size_t>(p) * rg;
          gv += l.s_gu * dotf(B + static_cast<size_t>(tk.c0 + rr) * rg, ap, rg);
          uv += l.s_gu * dotf(B + static_cast<size_t>(I + tk.c0 + rr) * rg, ap, rg);
        }
        dst[tk.c0 + rr] = gv;
        dst[I + tk.c0 + rr] = uv;
      }
    }
  });
}

const float* MoETrain::glu_row(const KernelTable& kt, const Routing& rt, int p, const float* gu, const LoraArgs& l,
                               float* h, float* a_d) const {
  const int I = I_;
  const float* gr = gu + static_cast<size_t>(rt.pair_slot[p]) * 2 * I;
  float* hr = h + static_cast<size_t>(p) * I;
  kt.glu(static_cast<int>(act_), gr, gr + I, hr, I, alpha_, limit_);
  if (a_d) {
    const float* A = l.A_d + static_cast<size_t>(rt.pair_exp[p]) * l.r_d * I;
    for (int j = 0; j < l.r_d; ++j) a_d[static_cast<size_t>(p) * l.r_d + j] = dotf(A + static_cast<size_t>(j) * I, hr, I);
  }
  return hr;
}

void MoETrain::forward(ThreadPool& pool, int T, int k, const float* x, const int64_t* ids, const float* w,
                       const LoraArgs& l, float* out, float* save_gu) {
  if (T < 0 || k <= 0) throw std::invalid_argument("MoETrain.forward: need T >= 0 and k > 0");
  check_lora(l);
  if (T == 0) return;
  std::lock_guard<std::mutex> lock(s_.mu);
  const KernelTable& kt = kernels();
  const int H = H_, I = I_, nth = pool.size();
  const ProjWeights& pd = base_->proj(2);
  Routing& rt = rt_;
  route(T, k, ids, rt);
  const int P = rt.P;
  if (static_cast<int>(s_.thr.size()) < nth) s_.thr = std::vector<AlignedBuf>(nth);
  for (int i = 0; i < nth; ++i) s_.thr[i].ensure(thr_floats_ * sizeof(float));

  float* a_gu = l.A_gu ? static_cast<float*>(s_.a_gu.ensure(sizeof(float) * std::max(P, 1) * l.r_gu)) : nullptr;
  float* gu = save_gu ? save_gu : static_cast<float*>(s_.gu.ensure(sizeof(float) * 2 * I * static_cast<size_t>(T) * k));
  gate_up(pool, rt, T, x, l, a_gu, gu);

  // h = act(g) * u, its LoRA-A product, and its rows in the down weights' activation format
  float* h = static_cast<float*>(s_.h.ensure(sizeof(float) * std::max(P, 1) * static_cast<size_t>(I)));
  float* a_d = l.A_d ? static_cast<float*>(s_.a_d.ensure(sizeof(float) * std::max(P, 1) * l.r_d)) : nullptr;
  const size_t sd = act_row_bytes(pd.act, pd.Kpad);
  uint8_t* hq = static_cast<uint8_t*>(s_.hq.ensure(sd * std::max(P, 1)));
  pool.parallel_for(chunks(P), [&](int task, int) {
    for (int p = task * kChunk; p < std::min(P, (task + 1) * kChunk); ++p) {
      const float* hr = glu_row(kt, rt, p, gu, l, h, a_d);
      kt.quantize_act(pd.act, hr, I, pd.Kpad, hq + sd * p);
    }
  });

  // y = W_d h + s_d B_d a_d  -> [P, H]
  float* y = static_cast<float*>(s_.y.ensure(sizeof(float) * std::max(P, 1) * static_cast<size_t>(H)));
  const std::vector<Task> tasks = row_tasks(rt.counts, rt.offsets, H, nth);
  const size_t tmp_bytes = (thr_floats_ - 2 * kTile) * sizeof(float);
  pool.parallel_for(static_cast<int>(tasks.size()), [&](int ti, int tid) {
    const Task tk = tasks[ti];
    const int nt = tk.nt, nr = tk.nc, p0 = tk.p0;
    const uint8_t* A[kTokBlock];
    for (int t = 0; t < nt; ++t) A[t] = hq + sd * (p0 + t);
    float* C = y + static_cast<size_t>(p0) * H + tk.c0;
    GemmArgs g;
    g.A = A; g.nt = nt; g.C = C; g.ldc = H; g.tmp = thread_buf(tid) + 2 * kTile; g.tmp_bytes = tmp_bytes;
    pd.setup(g, tk.e, tk.c0, nr);
    pd.gemm(g);
    if (a_d) {
      const float* B = l.B_d + static_cast<size_t>(tk.e) * H * l.r_d;
      for (int t = 0; t < nt; ++t) {
        const float* ap = a_d + static_cast<size_t>(p0 + t) * l.r_d;
        for (int rr = 0; rr < nr; ++rr)
          C[static_cast<size_t>(t) * H + rr] += l.s_d * dotf(B + static_cast<size_t>(tk.c0 + rr) * l.r_d, ap, l.r_d);
      }
    }
  });

  // out[t] = sum_j w[t, j] y[pair(t, j)]
  combine_slots(pool, kt, rt.pair_slot, P, T, k, H, w, y, out);
}

void MoETrain::backward(ThreadPool& pool, int T, int k, const float* x, const int64_t* ids, const float* w,
                        const LoraArgs& l, const float* saved_gu, const float* dout, float* dx, float* dw,
                        const LoraGrads& grads) {
  if (T < 0 || k <= 0) throw std::invalid_argument("MoETrain.backward: need T >= 0 and k > 0");
  check_lora(l);
  if ((l.A_gu && (!grads.A_gu || !grads.B_gu)) || (l.A_d && (!grads.A_d || !grads.B_d)))
    throw std::invalid_argument("MoETrain.backward: LoRA given without buffers for its gradients");
  const KernelTable& kt = kernels();
  const int E = E_, H = H_, I = I_, nth = pool.size();
  const ProjWeights& pg = base_->proj(0);
  const ProjWeights& pu = base_->proj(1);
  const ProjWeights& pd = base_->proj(2);
  const int rg = l.r_gu, rd = l.r_d;
  if (l.A_gu) {
    std::memset(grads.A_gu, 0, sizeof(float) * E * rg * static_cast<size_t>(H));
    std::memset(grads.B_gu, 0, sizeof(float) * E * 2 * static_cast<size_t>(I) * rg);
  }
  if (l.A_d) {
    std::memset(grads.A_d, 0, sizeof(float) * E * rd * static_cast<size_t>(I));
    std::memset(grads.B_d, 0, sizeof(float) * E * static_cast<size_t>(H) * rd);
  }
  if (T == 0) return;
  std::lock_guard<std::mutex> lock(s_.mu);
  Routing& rt = rt_;
  route(T, k, ids, rt);
  const int P = rt.P;
  if (static_cast<int>(s_.thr.size()) < nth) s_.thr = std::vector<AlignedBuf>(nth);
  for (int i = 0; i < nth; ++i) s_.thr[i].ensure(thr_floats_ * sizeof(float));
  auto tok_of = [&](int p) { return rt.pair_slot[p] / k; };

  // 1. Pre-activations (saved or recomputed), LoRA-A products, h.
  float* a_gu = l.A_gu ? static_cast<float*>(s_.a_gu.ensure(sizeof(float) * std::max(P, 1) * rg)) : nullptr;
  float* gu_re = saved_gu ? nullptr : static_cast<float*>(s_.gu.ensure(sizeof(float) * 2 * I * static_cast<size_t>(T) * k));
  gate_up(pool, rt, T, x, l, a_gu, gu_re);
  const float* gu = saved_gu ? saved_gu : gu_re;
  float* h = static_cast<float*>(s_.h.ensure(sizeof(float) * std::max(P, 1) * static_cast<size_t>(I)));
  float* a_d = l.A_d ? static_cast<float*>(s_.a_d.ensure(sizeof(float) * std::max(P, 1) * rd)) : nullptr;
  float* bd = l.A_d ? static_cast<float*>(s_.bd.ensure(sizeof(float) * std::max(P, 1) * rd)) : nullptr;
  pool.parallel_for(chunks(P), [&](int task, int) {
    for (int p = task * kChunk; p < std::min(P, (task + 1) * kChunk); ++p) {
      glu_row(kt, rt, p, gu, l, h, a_d);
      if (a_d) {
        const int e = rt.pair_exp[p];
        // bd = B_d^T dout[t] (unweighted)
        const float* B = l.B_d + static_cast<size_t>(e) * H * rd;
        const float* d = dout + static_cast<size_t>(tok_of(p)) * H;
        float* b = bd + static_cast<size_t>(p) * rd;
        std::fill(b, b + rd, 0.f);
        for (int r = 0; r < H; ++r) axpy_small(d[r], B + static_cast<size_t>(r) * rd, b, rd);
      }
    }
  });

  // 2. gy = W_d^T dout[t] per pair  [P, I]
  // (the same buffer holds dx per pair in step 5, once gy is spent)
  float* gy = static_cast<float*>(s_.y.ensure(sizeof(float) * std::max(P, 1) * static_cast<size_t>(std::max(H, I))));
  std::memset(gy, 0, sizeof(float) * P * static_cast<size_t>(I));
  std::vector<Task> tasks;
  auto col_tasks = [&](int cols) { expert_tasks(rt.counts, rt.offsets, cols, kColBlock, tasks); };
  col_tasks(I);
  const TransposedGemm tg_d{{&pd, nullptr}, 1, H, (H + kBf16KAlign - 1) / kBf16KAlign * kBf16KAlign};
  const TransposedGemm tg_gu{{&pg, &pu}, 2, 2 * I, (2 * I + kBf16KAlign - 1) / kBf16KAlign * kBf16KAlign};
  const bool gemm_d = gemm_transposed(pd) && H % 2 == 0;
  const bool gemm_gu = gemm_transposed(pg) && gemm_transposed(pu) && I % 2 == 0;
  const ActFmt tfmt = kt.packed_bf16_act;
  // per thread: the packed slice, then the fp32 / bf16 rows it is built from
  const size_t pack_bytes = static_cast<size_t>(kColBlock) * std::max(tg_d.Kpad, tg_gu.Kpad) * 2;
  if (gemm_d || gemm_gu) {
    const size_t aux = static_cast<size_t>(kPanelRows) * kColBlock * (4 + 2) + 4 * kColBlock + 64;
    if (static_cast<int>(s_.tpack.size()) < nth) s_.tpack = std::vector<AlignedBuf>(nth);
    for (int i = 0; i < nth; ++i) s_.tpack[i].ensure(pack_bytes + aux);
  }
  auto pack_buf = [&](int tid) { return static_cast<uint8_t*>(s_.tpack[tid].data()); };
  auto aux_buf = [&](int tid) { return reinterpret_cast<float*>(pack_buf(tid) + pack_bytes); };
  // activation rows for the GEMM path: dout per token (step 2), dgu per pair (step 5)
  const size_t sa_d = act_row_bytes(tfmt, tg_d.Kpad), sa_gu = act_row_bytes(tfmt, tg_gu.Kpad);
  uint8_t* ta = (gemm_d || gemm_gu)
                    ? static_cast<uint8_t*>(s_.ta.ensure(std::max(sa_d * T, sa_gu * std::max(P, 1))))
                    : nullptr;
  if (gemm_d)
    pool.parallel_for(chunks(T), [&](int task, int) {
      for (int t = task * kChunk; t < std::min(T, (task + 1) * kChunk); ++t)
        kt.quantize_act(tfmt, dout + static_cast<size_t>(t) * H, H, tg_d.Kpad, ta + sa_d * t);
    });
  pool.parallel_for(static_cast<int>(tasks.size()), [&](int ti, int tid) {
    const Task tk = tasks[ti];
    const int nt = tk.nt, nc = tk.nc, p0 = tk.p0;
    if (gemm_d) {
      const uint8_t* A[kTokBlock];
      for (int t = 0; t < nt; ++t) A[t] = ta + sa_d * tok_of(p0 + t);
      transposed_gemm(kt, tg_d, tk.e, tk.c0, nc, A, nt, gy + static_cast<size_t>(p0) * I + tk.c0, I, pack_buf(tid), aux_buf(tid));
      return;
    }
    const float* coef[kTokBlock];
    float* C[kTokBlock];
    for (int t = 0; t < nt; ++t) {
      coef[t] = dout + static_cast<size_t>(tok_of(p0 + t)) * H;
      C[t] = gy + static_cast<size_t>(p0 + t) * I + tk.c0;
    }
    transposed_product(kt, pd, tk.e, tk.c0, nc, coef, C, nt, thread_buf(tid) + 2 * kTile);
  });

  // 3. dw, dh = w (gy + s_d A_d^T bd), then dg/du  [P, 2I]
  float* dgu = static_cast<float*>(s_.g1.ensure(sizeof(float) * std::max(P, 1) * 2 * static_cast<size_t>(I)));
  for (int i = 0; i < T * k; ++i) dw[i] = 0.f;
  pool.parallel_for(chunks(P), [&](int task, int) {
    for (int p = task * kChunk; p < std::min(P, (task + 1) * kChunk); ++p) {
      const int slot = rt.pair_slot[p], e = rt.pair_exp[p];
      float* g = gy + static_cast<size_t>(p) * I;
      const float* hr = h + static_cast<size_t>(p) * I;
      float v = dotf(g, hr, I);
      if (a_d) {
        const float* b = bd + static_cast<size_t>(p) * rd;
        v += l.s_d * dotf(b, a_d + static_cast<size_t>(p) * rd, rd);
        const float* A = l.A_d + static_cast<size_t>(e) * rd * I;
        for (int j = 0; j < rd; ++j) kt.axpy(l.s_d * b[j], A + static_cast<size_t>(j) * I, g, I);
      }
      dw[slot] = v;
      const float wt = w[slot];
      for (int i = 0; i < I; ++i) g[i] *= wt;
      const float* gr = gu + static_cast<size_t>(slot) * 2 * I;
      float* o = dgu + static_cast<size_t>(p) * 2 * I;
      glu_backward(act_, gr, gr + I, g, o, o + I, I, alpha_, limit_);
    }
  });

  // 4. b_gu = B_gu^T dgu  [P, r_gu]
  float* b_gu = l.A_gu ? static_cast<float*>(s_.b_gu.ensure(sizeof(float) * std::max(P, 1) * rg)) : nullptr;
  if (b_gu) {
    pool.parallel_for(chunks(P), [&](int task, int) {
      for (int p = task * kChunk; p < std::min(P, (task + 1) * kChunk); ++p) {
        const float* B = l.B_gu + static_cast<size_t>(rt.pair_exp[p]) * 2 * I * rg;
        const float* d = dgu + static_cast<size_t>(p) * 2 * I;
        float* b = b_gu + static_cast<size_t>(p) * rg;
        std::fill(b, b + rg, 0.f);
        for (int r = 0; r < 2 * I; ++r) axpy_small(d[r], B + static_cast<size_t>(r) * rg, b, rg);
      }
    });
  }

  // 5. dx per pair = W_g^T dg + W_u^T du + s_gu A_gu^T b_gu  [P, H]
  float* dxp = gy;
  std::memset(dxp, 0, sizeof(float) * P * static_cast<size_t>(H));
  col_tasks(H);
  if (gemm_gu)
    pool.parallel_for(chunks(P), [&](int task, int) {
      for (int p = task * kChunk; p < std::min(P, (task + 1) * kChunk); ++p)
        kt.quantize_act(tfmt, dgu + static_cast<size_t>(p) * 2 * I, 2 * I, tg_gu.Kpad, ta + sa_gu * p);
    });
  pool.parallel_for(static_cast<int>(tasks.size()), [&](int ti, int tid) {
    const Task tk = tasks[ti];
    const int nt = tk.nt, nc = tk.nc, p0 = tk.p0;
    const float* cg[kTokBlock];
    const float* cu[kTokBlock];
    float* C[kTokBlock];
    for (int t = 0; t < nt; ++t) {
      cg[t] = dgu + static_cast<size_t>(p0 + t) * 2 * I;
      cu[t] = cg[t] + I;
      C[t] = dxp + static_cast<size_t>(p0 + t) * H + tk.c0;
    }
    if (gemm_gu) {
      const uint8_t* A[kTokBlock];
      for (int t = 0; t < nt; ++t) A[t] = ta + sa_gu * (p0 + t);
      transposed_gemm(kt, tg_gu, tk.e, tk.c0, nc, A, nt, C[0], H, pack_buf(tid), aux_buf(tid));
    } else {
      float* buf = thread_buf(tid) + 2 * kTile;
      transposed_product(kt, pg, tk.e, tk.c0, nc, cg, C, nt, buf);
      transposed_product(kt, pu, tk.e, tk.c0, nc, cu, C, nt, buf);
    }
    if (b_gu) {
      const float* A = l.A_gu + static_cast<size_t>(tk.e) * rg * H + tk.c0;
      for (int t = 0; t < nt; ++t) {
        const float* b = b_gu + static_cast<size_t>(p0 + t) * rg;
        for (int j = 0; j < rg; ++j) kt.axpy(l.s_gu * b[j], A + static_cast<size_t>(j) * H, C[t], nc);
      }
    }
  });

  // 6. dx[t] = sum over the token's slots
  combine_slots(pool, kt, rt.pair_slot, P, T, k, H, nullptr, dxp, dx);

  // 7. LoRA gradients, one task per (expert, matrix, row block): each output row has one owner.
  if (!l.A_gu && !l.A_d) return;
  struct GTask { int e, kind, r0; };
  std::vector<GTask> gt;
  constexpr int kGRows = 64;
  for (int e = 0; e < E; ++e) {
    if (!rt.counts[e]) continue;
    if (l.A_d) {
      for (int r0 = 0; r0 < H; r0 += kGRows) gt.push_back({e, 0, r0});  // B_d rows
      for (int j = 0; j < rd; ++j) gt.push_back({e, 1, j});            // A_d rows
    }
    if (l.A_gu) {
      for (int r0 = 0; r0 < 2 * I; r0 += kGRows) gt.push_back({e, 2, r0});  // B_gu rows
      for (int j = 0; j < rg; ++j) gt.push_back({e, 3, j});                // A_gu rows
    }
  }
  pool.parallel_for(static_cast<int>(gt.size()), [&](int ti, int) {
    const GTask g = gt[ti];
    const int pb = rt.offsets[g.e], pe = rt.offsets[g.e + 1];
    if (g.kind == 0) {  // dB_d[r, :] = s_d sum_p w_p dout_t[r] a_d_p
      float* G = grads.B_d + static_cast<size_t>(g.e) * H * rd;
      const int r1 = std::min(H, g.r0 + kGRows);
      for (int p = pb; p < pe; ++p) {
        const float c = l.s_d * w[rt.pair_slot[p]];
        const float* d = dout + static_cast<size_t>(tok_of(p)) * H;
        const float* a = a_d + static_cast<size_t>(p) * rd;
        for (int r = g.r0; r < r1; ++r) axpy_small(c * d[r], a, G + static_cast<size_t>(r) * rd, rd);
      }
    } else if (g.kind == 1) {  // dA_d[j, :] = s_d sum_p w_p bd_p[j] h_p
      float* G = grads.A_d + (static_cast<size_t>(g.e) * rd + g.r0) * I;
      for (int p = pb; p < pe; ++p)
        kt.axpy(l.s_d * w[rt.pair_slot[p]] * bd[static_cast<size_t>(p) * rd + g.r0], h + static_cast<size_t>(p) * I, G, I);
    } else if (g.kind == 2) {  // dB_gu[r, :] = s_gu sum_p dgu_p[r] a_gu_p
      float* G = grads.B_gu + static_cast<size_t>(g.e) * 2 * I * rg;
      const int r1 = std::min(2 * I, g.r0 + kGRows);
      for (int p = pb; p < pe; ++p) {
        const float* d = dgu + static_cast<size_t>(p) * 2 * I;
        const float* a = a_gu + static_cast<size_t>(p) * rg;
        for (int r = g.r0; r < r1; ++r) axpy_small(l.s_gu * d[r], a, G + static_cast<size_t>(r) * rg, rg);
      }
    } else {  // dA_gu[j, :] = s_gu sum_p b_gu_p[j] x_t
      float* G = grads.A_gu + (static_cast<size_t>(g.e) * rg + g.r0) * H;
      for (int p = pb; p < pe; ++p)
        kt.axpy(l.s_gu * b_gu[static_cast<size_t>(p) * rg + g.r0], x + static_cast<size_t>(tok_of(p)) * H, G, H);
    }
  });
}

}  // namespace kt
