// pybind11 surface of the CPU kernel library.  The core takes raw pointers, shapes and
// ggml types; torch is not linked.  Pointers are plain Python ints (data_ptr() / numpy
// __array_interface__ addresses); ktransformers/kernels/ wraps this with validation.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "flash_attn.h"
#include "kernels.h"
#include "linear.h"
#include "moe.h"
#include "quantize_ref.h"
#include "thread_pool.h"
#include "weights.h"

namespace py = pybind11;
namespace kt {
void bind_moe_train(py::module_& m);  // moe_backward_bindings.cpp
}
using namespace kt;

namespace kt {
void register_decode_ops(py::module_& m);
}

namespace {

template <class T>
const T* cptr(uintptr_t p) { return reinterpret_cast<const T*>(p); }

Backend to_backend(int b) {
  if (b < 0 || b >= kNumBackends)
    throw std::invalid_argument("backend must be 0 (llamafile), 1 (AMXInt8), 2 (AMXBF16), 3 (AMXInt4) or 4 (AMXInt4_1)");
  return static_cast<Backend>(b);
}
DType to_dtype(int d) {
  if (d != 0 && d != 1) throw std::invalid_argument("dtype must be 0 (float32) or 1 (bfloat16)");
  return static_cast<DType>(d);
}

// Read bandwidth: each pool thread sums its slice of an nbytes buffer; best of reps, GB/s.
double probe_read_bw(CPUInfer& ci, size_t nbytes, int reps) {
  const KernelTable& kt = kernels();
  const size_t n = nbytes / sizeof(float);
  AlignedBuf buf;
  float* p = static_cast<float*>(buf.ensure(n * sizeof(float)));
  ThreadPool& pool = ci.pool();
  const int nth = pool.size();
  pool.parallel_for(nth, [&](int i, int) {
    for (size_t j = n * i / nth; j < n * (i + 1) / nth; ++j) p[j] = 1.0f;
  });
  double best = 0;
  std::vector<float> sink(nth);
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(nth, [&](int i, int) { sink[i] = kt.probe_read(p + n * i / nth, n * (i + 1) / nth - n * i / nth); });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, nbytes / s / 1e9);
  }
  return best;
}

// Register-only peak (GFLOP/s or GOP/s) with all pool threads: kind 0 fp32 fma, 1 bf16 dot, 2 int8 dot.
double probe_peak(CPUInfer& ci, int kind, int64_t iters) {
  const KernelTable& kt = kernels();
  ThreadPool& pool = ci.pool();
  const int nth = pool.size();
  std::vector<double> ops(nth);
  const auto t0 = std::chrono::steady_clock::now();
  pool.parallel_for(nth, [&](int i, int) { ops[i] = kt.probe_peak(kind, iters); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double tot = 0;
  for (double o : ops) tot += o;
  return tot / s / 1e9;
}

// How many times parallel_for ran each of ntasks tasks over reps calls on a fresh pool, and how
// many tasks each thread ran; task i spins ~(i % 7) us so that the threads' ranges finish at
// different times and the stealing path runs.  A task whose index is `throw_at` throws.
std::tuple<std::vector<int>, std::vector<int>, std::string> pool_task_counts(int threads, int ntasks, int reps, int throw_at) {
  ThreadPool pool(threads);
  std::vector<std::atomic<int>> runs(std::max(ntasks, 1));
  std::vector<std::atomic<int>> by_thread(threads);
  std::string err;
  for (int r = 0; r < reps; ++r) {
    try {
      pool.parallel_for(ntasks, [&](int i, int tid) {
        const auto t0 = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(i % 7)) {
        }
        runs[i].fetch_add(1);
        by_thread[tid].fetch_add(1);
        if (i == throw_at) throw std::runtime_error("task " + std::to_string(i));
      });
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  std::vector<int> a(ntasks), b(threads);
  for (int i = 0; i < ntasks; ++i) a[i] = runs[i].load();
  for (int i = 0; i < threads; ++i) b[i] = by_thread[i].load();
  return {a, b, err};
}

}  // namespace

PYBIND11_MODULE(KT_EXT_NAME, m) {
  kt::register_decode_ops(m);  // decode_ops.cpp
  m.doc() = "ktransformers CPU kernels (see ktransformers.kernels for the documented Python API)";
  m.def("isa_tier", [] { return std::string(kt::tier_name(kt::active_tier())); },
        "ISA tier in force (best supported, or lowered by KT_ISA)");
  m.def("best_isa_tier", [] { return std::string(kt::tier_name(kt::best_supported_tier())); });
  m.def("supported_isa_tiers", [] {
    py::list out;
    for (int t = 0; t <= static_cast<int>(kt::IsaTier::AMX); ++t)
      if (kt::tier_supported(static_cast<kt::IsaTier>(t))) out.append(std::string(kt::tier_name(static_cast<kt::IsaTier>(t))));
    return out;
  }, "every tier KT_ISA may name on this CPU, lowest first");
  m.def("_pool_task_counts", &pool_task_counts, py::arg("threads"), py::arg("ntasks"), py::arg("reps"),
        py::arg("throw_at") = -1, py::call_guard<py::gil_scoped_release>(), "thread-pool self-check (tests)");
  m.def("kernel_table", [] { return std::string(kernels().name); }, "name of the dispatched kernel table");
  m.def("kernel_rows", [] {
    const KernelTable& t = kernels();
    py::dict d;
    for (int ty = 0; ty < kMaxGgmlType; ++ty)
      if (t.lf_gemm[ty])
        d[py::str(kt::type_info(ty).name)] = py::make_tuple(std::string(t.lf_decode[ty]), std::string(t.lf_prefill[ty]),
                                                            std::string(act_fmt_name(t.lf_act[ty])));
    return d;
  }, "llamafile kernel table of the tier in force: {type name: (decode kernel, prefill kernel, activation format)}");
  m.def("packed_rows", [] {
    const KernelTable& t = kernels();
    const ActFmt acts[5] = {t.packed_i8_act, t.packed_bf16_act, t.packed_i4_act, t.packed_i4_act,
                            t.panels_q4k ? ActFmt::Q8_256 : t.lf_act[GGML_Q4_K]};
    py::dict d;
    for (int b = 1; b < kNumBackends; ++b)
      d[py::str(backend_name(static_cast<Backend>(b)))] =
          py::make_tuple(std::string(t.packed_decode[b - 1]), std::string(t.packed_prefill[b - 1]),
                         std::string(act_fmt_name(acts[b - 1])));
    return d;
  }, "packed backends of the tier in force: {backend: (decode kernel, prefill kernel, activation format)}");
  m.def("cpu_features", [] {
    const auto& f = kt::cpu_features();
    py::dict d;
    d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c; d["avx_vnni"] = f.avx_vnni;
    d["avx512f"] = f.avx512f; d["avx512bw"] = f.avx512bw; d["avx512vl"] = f.avx512vl;
    d["avx512vnni"] = f.avx512vnni; d["avx512bf16"] = f.avx512bf16;
    d["amx_tile"] = f.amx_tile; d["amx_int8"] = f.amx_int8; d["amx_bf16"] = f.amx_bf16;
    d["amx_os_enabled"] = f.amx_os_enabled;
    return d;
  });
  m.def("type_info", [](int type) {
    const TypeInfo& t = kt::type_info(type);
    return py::make_tuple(std::string(t.name), t.block_elems, t.block_bytes, t.supported);
  }, "(name, block_elems, block_bytes, supported) for a ggml type id");
  m.def("type_traits", [] {
    py::list out;
    for (int id = 0; id < kt::kMaxGgmlType; ++id) {
      try {
        const TypeInfo& t = kt::type_info(id);
        out.append(py::make_tuple(id, std::string(t.name), t.block_elems, t.block_bytes, t.supported));
      } catch (const std::invalid_argument&) {
      }
    }
    return out;
  }, "[(id, name, block_elems, block_bytes, kernels take it as a weight)] for every ggml type the C++ side knows");
  m.def("row_bytes", [](int type, int64_t cols) { return kt::row_bytes(type, cols); });
  m.def("check_row_len", [](int type, int64_t cols, const std::string& what) { kt::check_row_len(type, cols, what); });
  m.def("quantize_rows", [](int type, uintptr_t src, int64_t nrows, int64_t n_per_row, uintptr_t dst, int threads) {
    py::gil_scoped_release nogil;
    quantize_rows(type, cptr<float>(src), reinterpret_cast<void*>(dst), nrows, n_per_row, threads);
  }, "quantize nrows x n_per_row float32 at src into ggml blocks at dst (Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS; converter)");
  m.def("quantize_rows_supported", &quantize_rows_supported);
  m.def("dequantize", [](int type, uintptr_t src, int64_t n, uintptr_t dst) {
    check_row_len(type, n, "dequantize");
    py::gil_scoped_release nogil;
    kernels().dequant_row(type, cptr<void>(src), reinterpret_cast<float*>(dst), n);
  }, "dequantize n elements of `type` at src into float32 at dst (dispatched ISA)");

  py::class_<CPUInfer, std::shared_ptr<CPUInfer>>(m, "CPUInfer")
      .def(py::init<int>(), py::arg("threads"))
      .def_property_readonly("threads", &CPUInfer::threads)
      .def("sync", &CPUInfer::sync, py::call_guard<py::gil_scoped_release>(),
           "wait for all submitted tasks; re-raises the first task error")
      .def("probe_read_bw", &probe_read_bw, py::arg("nbytes"), py::arg("reps") = 5, py::call_guard<py::gil_scoped_release>())
      .def("probe_peak", &probe_peak, py::arg("kind"), py::arg("iters") = 20000000, py::call_guard<py::gil_scoped_release>())
      .def("checksum", [](CPUInfer& ci, uintptr_t data, size_t n) {
             uint64_t h = 0;
             py::gil_scoped_release nogil;
             ci.run_now([&] { h = checksum_bytes(cptr<uint8_t>(data), n, ci.pool()); });
             return h;
           }, py::arg("data"), py::arg("nbytes"), "64-bit checksum of a buffer (weights.h checksum_bytes)");

  py::class_<MoE, std::shared_ptr<MoE>>(m, "MoE")
      .def(py::init([](std::shared_ptr<CPUInfer> ci, int E, int H, int I, int backend, uintptr_t gate, uintptr_t up,
                       uintptr_t down, int gt, int ut, int dt, int act, float alpha, float limit, uintptr_t gate_bias,
                       uintptr_t up_bias, uintptr_t down_bias, uintptr_t prepacked) {
             MoEConfig c;
             c.prepacked = cptr<uint8_t>(prepacked);
             c.num_experts = E; c.hidden = H; c.intermediate = I; c.backend = to_backend(backend);
             c.gate = cptr<void>(gate); c.up = cptr<void>(up); c.down = cptr<void>(down);
             c.gate_type = gt; c.up_type = ut; c.down_type = dt;
             c.act = static_cast<Activation>(act); c.alpha = alpha; c.limit = limit;
             c.gate_bias = cptr<float>(gate_bias); c.up_bias = cptr<float>(up_bias); c.down_bias = cptr<float>(down_bias);
             std::shared_ptr<MoE> moe;
             py::gil_scoped_release nogil;
             ci->run_now([&] { moe = std::make_shared<MoE>(c, ci->pool()); });
             return moe;
           }),
           py::arg("pool"), py::arg("num_experts"), py::arg("hidden"), py::arg("intermediate"), py::arg("backend"),
           py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("gate_type"), py::arg("up_type"), py::arg("down_type"),
           py::arg("activation") = 0, py::arg("alpha") = 1.702f, py::arg("limit") = 7.0f, py::arg("gate_bias") = 0,
           py::arg("up_bias") = 0, py::arg("down_bias") = 0, py::arg("prepacked") = 0)
      .def_property_readonly("packed_bytes", &MoE::packed_bytes)
      .def_property_readonly("packed_ptr", [](const MoE& self) { return reinterpret_cast<uintptr_t>(self.packed_data()); })
      .def("submit", [](std::shared_ptr<MoE> self, std::shared_ptr<CPUInfer> ci, int T, int k, uintptr_t x, int xdt,
                        uintptr_t ids, uintptr_t w, uintptr_t out, int odt) {
             const DType xd = to_dtype(xdt), od = to_dtype(odt);
             CPUInfer* cp = ci.get();
             ci->submit([self, cp, T, k, x, xd, ids, w, out, od] {
               self->forward(cp->pool(), T, k, cptr<void>(x), xd, cptr<int64_t>(ids), cptr<float>(w),
                             reinterpret_cast<void*>(out), od);
             });
           })
      .def("forward", [](MoE& self, CPUInfer& ci, int T, int k, uintptr_t x, int xdt, uintptr_t ids, uintptr_t w,
                         uintptr_t out, int odt) {
             const DType xd = to_dtype(xdt), od = to_dtype(odt);
             py::gil_scoped_release nogil;
             ci.run_now([&] {
               self.forward(ci.pool(), T, k, cptr<void>(x), xd, cptr<int64_t>(ids), cptr<float>(w),
                            reinterpret_cast<void*>(out), od);
             });
           });

  bind_moe_train(m);

  // bytes of one stack of `count` [rows, cols] matrices of ggml type `type` once packed for `backend`
  // (0 for llamafile, which reads them in place): the memory plan's figure, read nothing
  m.def("packed_weight_bytes", [](int backend, int type, int count, int rows, int cols) {
        static const uint8_t placeholder = 0;  // describe_weights only checks the pointer is set
        return packed_bytes(describe_weights(to_backend(backend), &placeholder, type, count, rows, cols, "weights"));
      }, py::arg("backend"), py::arg("type"), py::arg("count"), py::arg("rows"), py::arg("cols"));

  py::class_<Linear, std::shared_ptr<Linear>>(m, "Linear")
      .def(py::init([](std::shared_ptr<CPUInfer> ci, int in_f, int out_f, int backend, uintptr_t weight, int wt) {
             std::shared_ptr<Linear> lin;
             const Backend b = to_backend(backend);
             py::gil_scoped_release nogil;
             ci->run_now([&] { lin = std::make_shared<Linear>(in_f, out_f, b, cptr<void>(weight), wt, ci->pool()); });
             return lin;
           }),
           py::arg("pool"), py::arg("in_features"), py::arg("out_features"), py::arg("backend"), py::arg("weight"),
           py::arg("weight_type"))
      .def("submit", [](std::shared_ptr<Linear> self, std::shared_ptr<CPUInfer> ci, int T, uintptr_t x, int xdt,
                        uintptr_t out, int odt) {
             const DType xd = to_dtype(xdt), od = to_dtype(odt);
             CPUInfer* cp = ci.get();
             ci->submit([self, cp, T, x, xd, out, od] {
               self->forward(cp->pool(), T, cptr<void>(x), xd, reinterpret_cast<void*>(out), od);
             });
           })
      .def("forward", [](Linear& self, CPUInfer& ci, int T, uintptr_t x, int xdt, uintptr_t out, int odt) {
             const DType xd = to_dtype(xdt), od = to_dtype(odt);
             py::gil_scoped_release nogil;
             ci.run_now([&] { self.forward(ci.pool(), T, cptr<void>(x), xd, reinterpret_cast<void*>(out), od); });
           });

  // fp32 in / fp32 out; the Python side (kernels/linear.py LinearGroupKernel) checks the buffers once
  py::class_<LinearGroup, std::shared_ptr<LinearGroup>>(m, "LinearGroup")
      .def(py::init([](std::vector<std::shared_ptr<Linear>> parts, int glu) {
             return std::make_shared<LinearGroup>(std::move(parts), glu);
           }),
           py::arg("parts"), py::arg("glu") = -1)
      .def_property_readonly("in_features", &LinearGroup::in_features)
      .def_property_readonly("out_features", &LinearGroup::out_features)
      .def("forward", [](LinearGroup& self, CPUInfer& ci, int T, uintptr_t x, uintptr_t out) {
             py::gil_scoped_release nogil;
             ci.run_now([&] { self.forward(ci.pool(), T, cptr<float>(x), reinterpret_cast<float*>(out)); });
           });

  // causal prompt attention (flash_attn.h); fp32 buffers and strides in floats, checked by
  // ktransformers/kernels/attention.py
  m.def("flash_attn_supported", &flash_attn_supported);
  m.def("flash_attn_prefill",
        [](CPUInfer& ci, uintptr_t q, size_t q_tok, size_t q_head, uintptr_t k, uintptr_t v, size_t kv_head,
           size_t kv_tok, uintptr_t out, size_t o_tok, size_t o_head, int H, int Hkv, int T, int D, int start,
           int window, float scale, bool bf16_pv, uintptr_t pages, int page_size, int key_first) {
          py::gil_scoped_release nogil;
          ci.run_now([&] {
            flash_attn_prefill(ci.pool(), cptr<float>(q), q_tok, q_head, cptr<float>(k), cptr<float>(v), kv_head,
                               kv_tok, reinterpret_cast<float*>(out), o_tok, o_head, H, Hkv, T, D, start, window, scale,
                               bf16_pv, cptr<int64_t>(pages), page_size, key_first);
          });
        },
        py::arg("cpu_infer"), py::arg("q"), py::arg("q_tok"), py::arg("q_head"), py::arg("k"), py::arg("v"),
        py::arg("kv_head"), py::arg("kv_tok"), py::arg("out"), py::arg("o_tok"), py::arg("o_head"), py::arg("H"),
        py::arg("Hkv"), py::arg("T"), py::arg("D"), py::arg("start"), py::arg("window"), py::arg("scale"),
        py::arg("bf16_pv"), py::arg("pages") = 0, py::arg("page_size") = 0, py::arg("key_first") = 0);
  // MLA attention in latent space (flash_attn.h); checked by ktransformers/kernels/attention.py
  m.def("mla_attention_supported", &mla_attention_supported);
  m.def("mla_attention",
        [](CPUInfer& ci, uintptr_t q_nope, size_t qn_tok, size_t qn_head, uintptr_t q_pe, size_t qp_tok,
           size_t qp_head, uintptr_t latent, size_t lat_tok, uintptr_t rope_key, size_t rk_tok, uintptr_t w_uk,
           uintptr_t w_uv_t, uintptr_t out, size_t o_tok, size_t o_head, int T, int H, int nope, int C, int R, int v,
           int start, float scale, uintptr_t pages, int page_size) {
          const MlaArgs a{cptr<float>(q_nope), qn_tok, qn_head, cptr<float>(q_pe), qp_tok, qp_head,
                          cptr<float>(latent), lat_tok, cptr<float>(rope_key), rk_tok, cptr<float>(w_uk),
                          cptr<float>(w_uv_t), reinterpret_cast<float*>(out), o_tok, o_head, T, H, nope, C, R, v,
                          start, scale, cptr<int64_t>(pages), page_size};
          py::gil_scoped_release nogil;
          ci.run_now([&] { mla_attention(ci.pool(), a); });
        },
        py::arg("cpu_infer"), py::arg("q_nope"), py::arg("qn_tok"), py::arg("qn_head"), py::arg("q_pe"),
        py::arg("qp_tok"), py::arg("qp_head"), py::arg("latent"), py::arg("lat_tok"), py::arg("rope_key"),
        py::arg("rk_tok"), py::arg("w_uk"), py::arg("w_uv_t"), py::arg("out"), py::arg("o_tok"), py::arg("o_head"),
        py::arg("T"), py::arg("H"), py::arg("nope"), py::arg("C"), py::arg("R"), py::arg("v"), py::arg("start"),
        py::arg("scale"), py::arg("pages") = 0, py::arg("page_size") = 0);
}
