// Run-time CPU feature detection: the single place that decides which ISA tier runs.
#pragma once
#include <string>

namespace kt {

// Ordered by capability for the kernels: a higher tier runs every instruction family the lower
// ones use, except that AVX512 and up do not imply AVX-VNNI (the 256-bit VEX vpdpbusd of
// Alder Lake / Zen 5), so whether a tier runs on this CPU is tier_supported(), not an order test.
enum class IsaTier : int { Scalar = 0, AVX2 = 1, AVXVNNI = 2, AVX512 = 3, AVX512VNNI = 4, AVX512BF16 = 5, AMX = 6 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx_vnni = false;  // VEX vpdpbusd / vpdpwssd on ymm (CPUID 7.1 EAX bit 4)
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false, avx512bf16 = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  bool amx_os_enabled = false;  // Linux arch_prctl(ARCH_REQ_XCOMP_PERM) granted
};

const CpuFeatures& cpu_features();
IsaTier best_supported_tier();
// Whether this CPU (and OS) can run tier t's kernel table.
bool tier_supported(IsaTier t);
// Tier in force: best supported, or the one KT_ISA=scalar|avx2|avxvnni|avx512|avx512vnni|avx512bf16|amx names
// (which must be supported: KT_ISA=avxvnni on an AVX-512 CPU without AVX-VNNI is refused).
IsaTier active_tier();
const char* tier_name(IsaTier t);

}  // namespace kt
