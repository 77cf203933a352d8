// pybind11 surface of the CPU kernel library.  The core takes raw pointers, shapes and
// ggml types; torch is not linked.
#include <pybind11/pybind11.h>

#include "cpu_features.h"

namespace py = pybind11;

PYBIND11_MODULE(KT_EXT_NAME, m) {
  m.doc() = "ktransformers CPU kernels";
  m.def("isa_tier", [] { return std::string(kt::tier_name(kt::active_tier())); },
        "ISA tier in force (best supported, or lowered by KT_ISA)");
  m.def("best_isa_tier", [] { return std::string(kt::tier_name(kt::best_supported_tier())); });
  m.def("cpu_features", [] {
    const auto& f = kt::cpu_features();
    py::dict d;
    d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c;
    d["avx512f"] = f.avx512f; d["avx512bw"] = f.avx512bw; d["avx512vl"] = f.avx512vl;
    d["avx512vnni"] = f.avx512vnni; d["avx512bf16"] = f.avx512bf16;
    d["amx_tile"] = f.amx_tile; d["amx_int8"] = f.amx_int8; d["amx_bf16"] = f.amx_bf16;
    d["amx_os_enabled"] = f.amx_os_enabled;
    return d;
  });
}
