#include "moe.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kt {
namespace {

constexpr int kTokBlock = 64;  // tokens of one expert handled by one task

// KT_MOE_PROFILE=N: print the mean time of each forward phase every N calls (development aid).
struct PhaseProf {
  int every = 0, calls = 0;
  double acc[8] = {};
  std::chrono::steady_clock::time_point t;
  PhaseProf() {
    const char* s = std::getenv("KT_MOE_PROFILE");
    every = s ? std::atoi(s) : 0;
  }
  void start() {
    if (every) t = std::chrono::steady_clock::now();
  }
  void mark(int i) {
    if (!every) return;
    const auto n = std::chrono::steady_clock::now();
    acc[i] += std::chrono::duration<double, std::micro>(n - t).count();
    t = n;
  }
  void end() {
    if (!every || ++calls % every) return;
    std::fprintf(stderr, "moe phases (us/call): route %.1f quant_x %.1f gate_up %.1f quant_h %.1f down %.1f sum %.1f\n",
                 acc[0] / calls, acc[1] / calls, acc[2] / calls, acc[3] / calls, acc[4] / calls, acc[5] / calls);
  }
};
PhaseProf& prof() {
  static PhaseProf p;
  return p;
}

std::string shape_str(int a, int b, int c) {
  return "[" + std::to_string(a) + ", " + std::to_string(b) + ", " + std::to_string(c) + "]";
}

// Row block: large for prefill (fewer tasks, more reuse), smaller when there are few experts
// hit so that every thread still gets several tasks.
int pick_row_block(int rows, int active_units, int threads) {
  int rb = 64;
  while (rb > 16 && static_cast<long>(active_units) * ((rows + rb - 1) / rb) < 8L * threads) rb /= 2;
  return rb;
}

// Per-expert gate / up biases (offset `at` into [E, I]) added to nt rows of nr gate and up outputs.
void add_row_bias(float* G, float* U, int nt, int nr, const float* gb, const float* ub, size_t at) {
  for (int t = 0; t < nt; ++t)
    for (int r = 0; r < nr; ++r) {
      if (gb) G[t * nr + r] += gb[at + r];
      if (ub) U[t * nr + r] += ub[at + r];
    }
}

}  // namespace

MoE::MoE(const MoEConfig& cfg, ThreadPool& pool) : cfg_(cfg) {
  const int E = cfg.num_experts, H = cfg.hidden, I = cfg.intermediate;
  if (E <= 0 || H <= 0 || I <= 0)
    throw std::invalid_argument("MoE: num_experts, hidden, intermediate must be positive, got " + shape_str(E, H, I));
  if (static_cast<int>(cfg.act) < 0 || static_cast<int>(cfg.act) > 3) throw std::invalid_argument("MoE: unknown activation");
  gate_ = describe_weights(cfg.backend, cfg.gate, cfg.gate_type, E, I, H, "gate_proj " + shape_str(E, I, H));
  up_ = describe_weights(cfg.backend, cfg.up, cfg.up_type, E, I, H, "up_proj " + shape_str(E, I, H));
  down_ = describe_weights(cfg.backend, cfg.down, cfg.down_type, E, H, I, "down_proj " + shape_str(E, H, I));
  if (cfg.backend != Backend::Llamafile) {
    const size_t bg = kt::packed_bytes(gate_), bu = kt::packed_bytes(up_), bd = kt::packed_bytes(down_);
    packed_size_ = bg + bu + bd;
    if (cfg.prepacked) {
      if (reinterpret_cast<uintptr_t>(cfg.prepacked) % 64)
        throw std::invalid_argument("MoE: the prepacked copy must be 64-byte aligned");
      packed_ptr_ = cfg.prepacked;
      adopt_packed(gate_, packed_ptr_);
      adopt_packed(up_, packed_ptr_ + bg);
      adopt_packed(down_, packed_ptr_ + bg + bu);
    } else {
      uint8_t* base = static_cast<uint8_t*>(packed_.ensure(packed_size_));  // one allocation per layer
      pack_weights(gate_, cfg.gate, base, pool);
      pack_weights(up_, cfg.up, base + bg, pool);
      pack_weights(down_, cfg.down, base + bg + bu, pool);
      packed_ptr_ = base;
    }
  }
}

void MoE::forward(ThreadPool& pool, int T, int k, const void* x, DType xdt, const int64_t* ids, const float* w,
                  void* out, DType odt) {
  if (T < 0 || k <= 0) throw std::invalid_argument("MoE.forward: need T >= 0 and k > 0");
  if (T == 0) return;
  const KernelTable& kt = kernels();
  const int E = cfg_.num_experts, H = cfg_.hidden, I = cfg_.intermediate;
  const int nth = pool.size();
  PhaseProf& pp = prof();
  pp.start();

  // 1. Route: group (token, slot) pairs by expert (counting sort, stable in token order).
  counts_.assign(E, 0);
  pair_of_.assign(static_cast<size_t>(T) * k, -1);
  for (int64_t i = 0; i < static_cast<int64_t>(T) * k; ++i) {
    const int64_t id = ids[i];
    if (id < 0) continue;
    if (id >= E)
      throw std::out_of_range("MoE.forward: expert id " + std::to_string(id) + " at [" + std::to_string(i / k) + ", " +
                              std::to_string(i % k) + "] is >= num_experts " + std::to_string(E));
    counts_[id]++;
  }
  offsets_.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) offsets_[e + 1] = offsets_[e] + counts_[e];
  const int P = offsets_[E];
  pair_tok_.resize(std::max(P, 1));
  {
    std::vector<int>& cur = tasks_;
    cur.assign(offsets_.begin(), offsets_.end() - 1);
    for (int64_t i = 0; i < static_cast<int64_t>(T) * k; ++i) {
      const int64_t id = ids[i];
      if (id < 0) continue;
      const int p = cur[id]++;
      pair_tok_[p] = static_cast<int>(i / k);
      pair_of_[i] = p;
    }
  }
  int active = 0;
  for (int e = 0; e < E; ++e) active += counts_[e] > 0;
  pp.mark(0);

  // Per-thread scratch: gate + up tiles (64 x kTokBlock each), then the GEMM scratch (large
  // enough for the prefill paths that unpack a weight panel once per token block), which the
  // x row conversion and the weighted sum reuse in their own phases.
  const int Kmax = std::max({gate_.Kpad, up_.Kpad, down_.Kpad, H, I});
  const size_t tile = 64 * kTokBlock;
  const size_t gemm_tmp = std::max(sizeof(float) * (2 * static_cast<size_t>(Kmax) + 64), kGemmPrefillTmp(Kmax));
  const size_t thr_floats = 2 * tile + (gemm_tmp + sizeof(float) - 1) / sizeof(float);
  if (static_cast<int>(thr_.size()) < nth) thr_ = std::vector<AlignedBuf>(nth);
  for (int i = 0; i < nth; ++i) thr_[i].ensure(thr_floats * sizeof(float));
  auto thr = [&](int tid) { return static_cast<float*>(thr_[tid].data()); };

  // 2. Quantise the input rows for gate (and up, if its format differs).
  const bool same_gu = gate_.act == up_.act && gate_.Kpad == up_.Kpad;
  const size_t sg = act_row_bytes(gate_.act, gate_.Kpad), su = act_row_bytes(up_.act, up_.Kpad);
  uint8_t* xg = static_cast<uint8_t*>(pool_scratch(pool, kScrMoeXaG).ensure(sg * T));
  uint8_t* xu = same_gu ? xg : static_cast<uint8_t*>(pool_scratch(pool, kScrMoeXaU).ensure(su * T));
  const int tok_chunk = 8;
  const int n_tok_tasks = (T + tok_chunk - 1) / tok_chunk;
  pool.parallel_for(n_tok_tasks, [&](int task, int tid) {
    float* xf = thr(tid) + 2 * tile + Kmax + 64;
    for (int t = task * tok_chunk; t < std::min(T, (task + 1) * tok_chunk); ++t) {
      const float* xr;
      if (xdt == DType::F32) {
        xr = static_cast<const float*>(x) + static_cast<size_t>(t) * H;
      } else {
        kt.bf16_to_f32_row(static_cast<const uint16_t*>(x) + static_cast<size_t>(t) * H, xf, H);
        xr = xf;
      }
      kt.quantize_act(gate_.act, xr, H, gate_.Kpad, xg + sg * t);
      if (!same_gu) kt.quantize_act(up_.act, xr, H, up_.Kpad, xu + su * t);
    }
  });

  pp.mark(1);
  // 3. gate & up + activation -> hbuf [P, I] fp32, tasks (expert, row block, token block).
  float* hbuf = static_cast<float*>(pool_scratch(pool, kScrMoeH).ensure(sizeof(float) * std::max(P, 1) * static_cast<size_t>(I)));
  std::vector<Task>& tasks = task_list_;
  tasks.clear();
  const int rb1 = pick_row_block(I, active, nth);
  for (int e = 0; e < E; ++e)
    for (int t0 = 0; t0 < counts_[e]; t0 += kTokBlock)
      for (int r0 = 0; r0 < I; r0 += rb1) tasks.push_back({e, r0, t0});
  const int act = static_cast<int>(cfg_.act);
  pool.parallel_for(static_cast<int>(tasks.size()), [&](int ti, int tid) {
    const Task tk = tasks[ti];
    const int nt = std::min(kTokBlock, counts_[tk.e] - tk.t0);
    const int nr = std::min(rb1, I - tk.r0);
    const int p0 = offsets_[tk.e] + tk.t0;
    const uint8_t* Ag[kTokBlock];
    const uint8_t* Au[kTokBlock];
    for (int t = 0; t < nt; ++t) {
      Ag[t] = xg + sg * pair_tok_[p0 + t];
      Au[t] = xu + su * pair_tok_[p0 + t];
    }
    float* G = thr(tid);
    float* U = G + tile;
    GemmArgs g;
    g.A = Ag; g.nt = nt; g.C = G; g.ldc = nr; g.tmp = U + tile; g.tmp_bytes = gemm_tmp;
    gate_.setup(g, tk.e, tk.r0, nr);
    GemmArgs u;
    u.A = Au; u.nt = nt; u.C = U; u.ldc = nr; u.tmp = U + tile; u.tmp_bytes = gemm_tmp;
    up_.setup(u, tk.e, tk.r0, nr);
    // each call's last row group fetches the first rows of what this thread reads next: up's,
    // then the next task's gate (tasks run in contiguous ranges per thread)
    first_rows(u, &g.next, &g.next_bytes);
    if (ti + 1 < static_cast<int>(tasks.size())) {
      GemmArgs n;
      gate_.setup(n, tasks[ti + 1].e, tasks[ti + 1].r0, std::min(rb1, I - tasks[ti + 1].r0));
      first_rows(n, &u.next, &u.next_bytes);
    }
    gate_.gemm(g);
    up_.gemm(u);
    if (cfg_.gate_bias || cfg_.up_bias) add_row_bias(G, U, nt, nr, cfg_.gate_bias, cfg_.up_bias, static_cast<size_t>(tk.e) * I + tk.r0);
    for (int t = 0; t < nt; ++t)
      kt.glu(act, G + t * nr, U + t * nr, hbuf + static_cast<size_t>(p0 + t) * I + tk.r0, nr, cfg_.alpha, cfg_.limit);
  });

  pp.mark(2);
  // 4. Quantise the intermediate rows for down.
  const size_t sd = act_row_bytes(down_.act, down_.Kpad);
  uint8_t* hq = static_cast<uint8_t*>(pool_scratch(pool, kScrMoeHa).ensure(sd * std::max(P, 1)));
  pool.parallel_for((P + tok_chunk - 1) / tok_chunk, [&](int task, int) {
    for (int p = task * tok_chunk; p < std::min(P, (task + 1) * tok_chunk); ++p)
      kt.quantize_act(down_.act, hbuf + static_cast<size_t>(p) * I, I, down_.Kpad, hq + sd * p);
  });

  pp.mark(3);
  // 5. down -> ybuf [P, H] fp32
  float* ybuf = static_cast<float*>(pool_scratch(pool, kScrMoeY).ensure(sizeof(float) * std::max(P, 1) * static_cast<size_t>(H)));
  tasks.clear();
  const int rb2 = pick_row_block(H, active, nth);
  for (int e = 0; e < E; ++e)
    for (int t0 = 0; t0 < counts_[e]; t0 += kTokBlock)
      for (int r0 = 0; r0 < H; r0 += rb2) tasks.push_back({e, r0, t0});
  pool.parallel_for(static_cast<int>(tasks.size()), [&](int ti, int tid) {
    const Task tk = tasks[ti];
    const int nt = std::min(kTokBlock, counts_[tk.e] - tk.t0);
    const int nr = std::min(rb2, H - tk.r0);
    const int p0 = offsets_[tk.e] + tk.t0;
    const uint8_t* A[kTokBlock];
    for (int t = 0; t < nt; ++t) A[t] = hq + sd * (p0 + t);
    GemmArgs g;
    g.A = A; g.nt = nt; g.C = ybuf + static_cast<size_t>(p0) * H + tk.r0; g.ldc = H; g.tmp = thr(tid) + 2 * tile;
    g.tmp_bytes = gemm_tmp;
    down_.setup(g, tk.e, tk.r0, nr);
    if (ti + 1 < static_cast<int>(tasks.size())) {
      GemmArgs n;
      down_.setup(n, tasks[ti + 1].e, tasks[ti + 1].r0, std::min(rb2, H - tasks[ti + 1].r0));
      first_rows(n, &g.next, &g.next_bytes);
    }
    down_.gemm(g);
  });

  pp.mark(4);
  // 6. Weighted sum over the k slots of each token.
  pool.parallel_for(n_tok_tasks, [&](int task, int tid) {
    float* acc = thr(tid) + 2 * tile + Kmax + 64;
    for (int t = task * tok_chunk; t < std::min(T, (task + 1) * tok_chunk); ++t) {
      float* o = odt == DType::F32 ? static_cast<float*>(out) + static_cast<size_t>(t) * H : acc;
      std::fill(o, o + H, 0.f);
      for (int j = 0; j < k; ++j) {
        const int p = pair_of_[static_cast<size_t>(t) * k + j];
        if (p < 0) continue;
        kt.axpy(w[static_cast<size_t>(t) * k + j], ybuf + static_cast<size_t>(p) * H, o, H);
        if (cfg_.down_bias) kt.axpy(w[static_cast<size_t>(t) * k + j], cfg_.down_bias + ids[static_cast<size_t>(t) * k + j] * H, o, H);
      }
      if (odt == DType::BF16) kt.f32_to_bf16_row(o, static_cast<uint16_t*>(out) + static_cast<size_t>(t) * H, H);
    }
  });
  pp.mark(5);
  pp.end();
}

}  // namespace kt
