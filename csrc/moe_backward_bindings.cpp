// pybind11 surface of the MoE training path (moe_backward.h); called from bindings.cpp.
#include <pybind11/pybind11.h>

#include <memory>

#include "moe_backward.h"

namespace py = pybind11;

namespace kt {
namespace {

template <class T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// (A_gu, B_gu, r_gu, s_gu, A_d, B_d, r_d, s_d); pointer 0 = no LoRA on that projection.
LoraArgs lora_args(const py::tuple& t) {
  if (t.size() != 8) throw std::invalid_argument("lora: expected (A_gu, B_gu, r_gu, s_gu, A_d, B_d, r_d, s_d)");
  LoraArgs l;
  l.A_gu = ptr<const float>(t[0].cast<uintptr_t>());
  l.B_gu = ptr<const float>(t[1].cast<uintptr_t>());
  l.r_gu = t[2].cast<int>();
  l.s_gu = t[3].cast<float>();
  l.A_d = ptr<const float>(t[4].cast<uintptr_t>());
  l.B_d = ptr<const float>(t[5].cast<uintptr_t>());
  l.r_d = t[6].cast<int>();
  l.s_d = t[7].cast<float>();
  return l;
}

}  // namespace

void bind_moe_train(py::module_& m) {
  py::class_<MoETrain, std::shared_ptr<MoETrain>>(m, "MoETrain")
      .def(py::init<std::shared_ptr<MoE>>(), py::arg("moe"))
      .def_static("scratch_bytes", &MoETrain::scratch_bytes,
                  "bytes of the call scratch all layers share (the largest call so far)")
      .def("forward", [](MoETrain& self, CPUInfer& ci, int T, int k, uintptr_t x, uintptr_t ids, uintptr_t w,
                         const py::tuple& lora, uintptr_t out, uintptr_t save_gu) {
             const LoraArgs l = lora_args(lora);
             py::gil_scoped_release nogil;
             ci.run_now([&] {
               self.forward(ci.pool(), T, k, ptr<const float>(x), ptr<const int64_t>(ids), ptr<const float>(w), l,
                            ptr<float>(out), ptr<float>(save_gu));
             });
           }, "fp32 forward with LoRA; save_gu (0 = none) receives [T*k, 2I] pre-activations")
      .def("backward", [](MoETrain& self, CPUInfer& ci, int T, int k, uintptr_t x, uintptr_t ids, uintptr_t w,
                          const py::tuple& lora, uintptr_t saved_gu, uintptr_t dout, uintptr_t dx, uintptr_t dw,
                          const py::tuple& grads) {
             const LoraArgs l = lora_args(lora);
             if (grads.size() != 4) throw std::invalid_argument("grads: expected (dA_gu, dB_gu, dA_d, dB_d)");
             LoraGrads g;
             g.A_gu = ptr<float>(grads[0].cast<uintptr_t>());
             g.B_gu = ptr<float>(grads[1].cast<uintptr_t>());
             g.A_d = ptr<float>(grads[2].cast<uintptr_t>());
             g.B_d = ptr<float>(grads[3].cast<uintptr_t>());
             py::gil_scoped_release nogil;
             ci.run_now([&] {
               self.backward(ci.pool(), T, k, ptr<const float>(x), ptr<const int64_t>(ids), ptr<const float>(w), l,
                             ptr<const float>(saved_gu), ptr<const float>(dout), ptr<float>(dx), ptr<float>(dw), g);
             });
           }, "grads of x, routing weights and LoRA (saved_gu 0 = recompute the pre-activations)");
}

}  // namespace kt
