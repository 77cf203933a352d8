// Run-time CPU feature detection: the single place that decides which ISA tier runs.
#pragma once
#include <string>

namespace kt {

enum class IsaTier : int { Scalar = 0, AVX2 = 1, AVX512 = 2, AVX512BF16 = 3, AMX = 4 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false, avx512bf16 = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  bool amx_os_enabled = false;  // Linux arch_prctl(ARCH_REQ_XCOMP_PERM) granted
};

const CpuFeatures& cpu_features();
IsaTier best_supported_tier();
// Tier in force: best supported, lowered by KT_ISA=scalar|avx2|avx512|avx512bf16|amx.
IsaTier active_tier();
const char* tier_name(IsaTier t);

}  // namespace kt
