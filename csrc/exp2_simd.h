// 2^x for the x <= 0 of a softmax (scores minus their max), on 16 lanes (AVX-512), 8 lanes (AVX2)
// and one float: a degree-7 polynomial of the fraction, times 2^floor.  |relative error| < 2e-7
// on [-126, 0].  The vector forms give 0 below -150 (scalef) or clamp at -126 (the exponent bits
// set directly, as the scalar form); 2^-126 next to the max's 1 is nothing.  Used by the prompt
// attention (flash_attn.cpp) and the decode attention (decode_ops.cpp).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kt {

// Horner coefficients of 2^f on [0, 1), highest degree first
constexpr float kExp2Poly[8] = {1.5252733e-5f, 1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f,
                                5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f};

__attribute__((target("avx512f"), always_inline)) inline __m512 exp2_ps512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  const __m512 fl = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, fl);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, fl);
}

__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp2_ps256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 fl = _mm256_floor_ps(x);
  const __m256 f = _mm256_sub_ps(x, fl);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fl), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __attribute__((always_inline)) float exp2_scalar(float x) {
  x = x < -126.f ? -126.f : x;
  const float fl = __builtin_floorf(x);
  const float f = x - fl;
  float p = kExp2Poly[0];
  for (int i = 1; i < 8; ++i) p = p * f + kExp2Poly[i];
  const uint32_t bits = static_cast<uint32_t>(static_cast<int>(fl) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace kt
