#include "cpu_features.h"

#include <cpuid.h>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kt {
namespace {

unsigned long long xgetbv0() {
  unsigned int eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

bool request_amx_permission() {
#if defined(__linux__)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
  constexpr long XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  if (!osxsave) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_ok = (xcr0 & 0x6) == 0x6;
  const bool zmm_ok = (xcr0 & 0xe6) == 0xe6;
  const bool tile_ok = (xcr0 & (3ull << 17)) == (3ull << 17);
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = ymm_ok && (b & (1u << 5));
  f.avx512f = zmm_ok && (b & (1u << 16));
  f.avx512bw = zmm_ok && (b & (1u << 30));
  f.avx512vl = zmm_ok && (b & (1u << 31));
  f.avx512vnni = zmm_ok && (c & (1u << 11));
  f.amx_bf16 = tile_ok && (d & (1u << 22));
  f.amx_tile = tile_ok && (d & (1u << 24));
  f.amx_int8 = tile_ok && (d & (1u << 25));
  __cpuid_count(7, 1, a, b, c, d);
  f.avx_vnni = ymm_ok && (a & (1u << 4));
  f.avx512bf16 = zmm_ok && (a & (1u << 5));
  if (f.amx_tile) f.amx_os_enabled = request_amx_permission();
  return f;
}

IsaTier parse_tier(const char* s) {
  std::string v(s);
  if (v == "scalar") return IsaTier::Scalar;
  if (v == "avx2") return IsaTier::AVX2;
  if (v == "avxvnni") return IsaTier::AVXVNNI;
  if (v == "avx512") return IsaTier::AVX512;
  if (v == "avx512vnni") return IsaTier::AVX512VNNI;
  if (v == "avx512bf16") return IsaTier::AVX512BF16;
  if (v == "amx") return IsaTier::AMX;
  throw std::invalid_argument("KT_ISA='" + v + "' is not one of scalar, avx2, avxvnni, avx512, avx512vnni, avx512bf16, amx");
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

bool tier_supported(IsaTier t) {
  const auto& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  const bool avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512vl;
  const bool vnni512 = avx512 && f.avx512vnni;  // Cascade Lake, Ice Lake: int8 dots, no bf16 dots
  const bool bf16 = vnni512 && f.avx512bf16;
  switch (t) {
    case IsaTier::Scalar: return true;
    case IsaTier::AVX2: return avx2;
    case IsaTier::AVXVNNI: return avx2 && f.avx_vnni;
    case IsaTier::AVX512: return avx512;
    case IsaTier::AVX512VNNI: return vnni512;
    case IsaTier::AVX512BF16: return bf16;
    case IsaTier::AMX: return bf16 && f.amx_tile && f.amx_int8 && f.amx_bf16 && f.amx_os_enabled;
  }
  return false;
}

IsaTier best_supported_tier() {
  // (an AVX-512 CPU with AVX-VNNI still gets its AVX-512 tiers: avxvnni is reached by KT_ISA)
  for (IsaTier t : {IsaTier::AMX, IsaTier::AVX512BF16, IsaTier::AVX512VNNI, IsaTier::AVX512, IsaTier::AVXVNNI, IsaTier::AVX2})
    if (tier_supported(t)) return t;
  return IsaTier::Scalar;
}

IsaTier active_tier() {
  static const IsaTier t = [] {
    IsaTier best = best_supported_tier();
    const char* env = std::getenv("KT_ISA");
    if (!env || !*env) return best;
    IsaTier want = parse_tier(env);
    if (!tier_supported(want)) {
      std::string have;
      for (int t = 0; t <= static_cast<int>(IsaTier::AMX); ++t)
        if (tier_supported(static_cast<IsaTier>(t))) have += std::string(have.empty() ? "" : ", ") + tier_name(static_cast<IsaTier>(t));
      throw std::runtime_error(std::string("KT_ISA=") + env + " asks for more than this CPU supports (best: " +
                               tier_name(best) + "; supported: " + have + ")");
    }
    return want;
  }();
  return t;
}

const char* tier_name(IsaTier t) {
  switch (t) {
    case IsaTier::Scalar: return "scalar";
    case IsaTier::AVX2: return "avx2";
    case IsaTier::AVXVNNI: return "avxvnni";
    case IsaTier::AVX512: return "avx512";
    case IsaTier::AVX512VNNI: return "avx512vnni";
    case IsaTier::AVX512BF16: return "avx512bf16";
    case IsaTier::AMX: return "amx";
  }
  return "?";
}

}  // namespace kt
