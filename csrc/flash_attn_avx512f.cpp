// The AVX-512 prompt / decode attention in fp32 for AVX-512 without BF16 (avx512 / avx512vnni tiers).
#define KT_FLASH_BF16 0
#include "flash_attn_avx512.inc"
