#include "linear.h"

#include <algorithm>
#include <utility>
#include <stdexcept>
#include <string>

namespace kt {

// Decode (T <= 4) of a large matrix: rows per task grown up to 512 while every thread still gets
// >= 64 tasks.  Each task start is a prefetch bubble and a claim on the shared ticket; the
// lm_head of a 262k vocabulary was 4096 tasks of 64 rows per call.
int decode_row_block(int rb, int T, long rows, int nth) {
  if (T > 4) return rb;
  while (rb < 512 && rows / (2L * rb) >= 64L * nth) rb *= 2;
  return rb;
}

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
  uint8_t* xa = static_cast<uint8_t*>(pool_scratch(pool, kScrLinXa).ensure(sa * T));
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
                               : static_cast<float*>(pool_scratch(pool, kScrLinY).ensure(sizeof(float) * static_cast<size_t>(T) * N));
  int rb = 64;
  const int ntb = (T + kTB - 1) / kTB;
  while (rb > (T >= 8 ? 32 : 16) && static_cast<long>(ntb) * ((N + rb - 1) / rb) < 8L * nth) rb /= 2;
  rb = decode_row_block(rb, T, N, nth);
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

LinearGroup::LinearGroup(std::vector<std::shared_ptr<Linear>> parts, int glu) : parts_(std::move(parts)), glu_(glu) {
  if (parts_.empty()) throw std::invalid_argument("LinearGroup: no linears");
  K_ = parts_[0]->in_features();
  for (const auto& p : parts_) {
    if (!p) throw std::invalid_argument("LinearGroup: a member is None");
    if (p->in_features() != K_)
      throw std::invalid_argument("LinearGroup: members read inputs of different sizes (" + std::to_string(K_) +
                                  " and " + std::to_string(p->in_features()) + ")");
    const ProjWeights& w = p->weights();
    offset_.push_back(total_);
    total_ += w.rows;
    int slot = -1;
    for (size_t a = 0; a < acts_.size(); ++a)
      if (acts_[a].first == w.act && acts_[a].second == w.Kpad) slot = static_cast<int>(a);
    if (slot < 0) {
      slot = static_cast<int>(acts_.size());
      acts_.emplace_back(w.act, w.Kpad);
    }
    act_slot_.push_back(slot);
    tmp_bytes_ = std::max(tmp_bytes_, std::max(sizeof(float) * (2 * static_cast<size_t>(w.Kpad) + 128),
                                               kGemmPrefillTmp(w.Kpad)));
  }
  if (glu_ >= 0 && (parts_.size() != 2 || parts_[0]->out_features() != parts_[1]->out_features()))
    throw std::invalid_argument("LinearGroup: a gated group needs two members of the same size (gate, up)");
  if (glu_ > 2) throw std::invalid_argument("LinearGroup: glu must be -1 (none), 0 (silu), 1 (gelu_tanh) or 2");
}

void LinearGroup::forward(ThreadPool& pool, int T, const float* x, float* out) {
  if (T < 0) throw std::invalid_argument("LinearGroup.forward: T must be >= 0");
  if (T == 0) return;
  const KernelTable& kt = kernels();
  const int nth = pool.size();
  constexpr int kTB = 256;
  if (static_cast<int>(thr_.size()) < nth) thr_ = std::vector<AlignedBuf>(nth);
  for (int i = 0; i < nth; ++i) thr_[i].ensure(tmp_bytes_);
  // one quantised copy of x per (format, Kpad); offsets into xa_
  size_t xa_off[8] = {}, xa_row[8] = {}, xa_total = 0;
  if (acts_.size() > 8) throw std::invalid_argument("LinearGroup: too many activation formats");
  for (size_t a = 0; a < acts_.size(); ++a) {
    xa_row[a] = act_row_bytes(acts_[a].first, acts_[a].second);
    xa_off[a] = xa_total;
    xa_total += xa_row[a] * T;
  }
  uint8_t* xa = static_cast<uint8_t*>(pool_scratch(pool, kScrLinXa).ensure(xa_total));
  const int nq = static_cast<int>(acts_.size()) * T;
  pool.parallel_for(nq < 2 ? 1 : (nq + 7) / 8, [&](int task, int) {
    for (int i = task * 8; i < std::min(nq, (task + 1) * 8); ++i) {
      const int a = i / T, t = i % T;
      kt.quantize_act(acts_[a].first, x + static_cast<size_t>(t) * K_, K_, acts_[a].second,
                      xa + xa_off[a] + xa_row[a] * t);
    }
  });
  float* y = glu_ >= 0 ? static_cast<float*>(pool_scratch(pool, kScrLinY).ensure(sizeof(float) * static_cast<size_t>(T) * total_)) : out;
  // row blocks over all members: 64 rows, halved while there are fewer than 8 tasks per thread
  const int tclass = T >= 8 ? 1 : 0;
  if (tasks_nth_ != nth || tasks_tclass_ != tclass) {
    int rb = 64;
    auto count = [&](int r) {
      long n = 0;
      for (const auto& p : parts_) n += (p->out_features() + r - 1) / r;
      return n;
    };
    while (rb > (tclass ? 32 : 16) && count(rb) < 8L * nth) rb /= 2;
    long most = 0;
    for (const auto& p : parts_) most = std::max<long>(most, p->out_features());
    rb = decode_row_block(rb, tclass ? 8 : 1, most, nth);
    tasks_.clear();
    for (size_t i = 0; i < parts_.size(); ++i)
      for (int r0 = 0; r0 < parts_[i]->out_features(); r0 += rb)
        tasks_.push_back({static_cast<int>(i), r0, std::min(rb, parts_[i]->out_features() - r0)});
    tasks_nth_ = nth;
    tasks_tclass_ = tclass;
  }
  const int nrt = static_cast<int>(tasks_.size());
  const int ntb = (T + kTB - 1) / kTB;
  pool.parallel_for(nrt * ntb, [&](int task, int tid) {
    const Task& tk = tasks_[task % nrt];
    const int t0 = (task / nrt) * kTB, nt = std::min(kTB, T - t0);
    const int a = act_slot_[tk.part];
    const uint8_t* A[kTB];
    for (int t = 0; t < nt; ++t) A[t] = xa + xa_off[a] + xa_row[a] * (t0 + t);
    const ProjWeights& w = parts_[tk.part]->weights();
    GemmArgs g;
    g.A = A; g.nt = nt; g.C = y + static_cast<size_t>(t0) * total_ + offset_[tk.part] + tk.r0; g.ldc = total_;
    g.tmp = static_cast<float*>(thr_[tid].data());
    g.tmp_bytes = tmp_bytes_;
    w.setup(g, 0, tk.r0, tk.nr);
    w.gemm(g);
  });
  if (glu_ >= 0) {
    const int n = total_ / 2;
    for (int t = 0; t < T; ++t) {
      const float* yt = y + static_cast<size_t>(t) * total_;
      kt.glu(glu_, yt, yt + n, out + static_cast<size_t>(t) * n, n, 1.702f, 7.0f);
    }
  }
}

}  // namespace kt
