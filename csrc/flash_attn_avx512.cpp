// The AVX-512 prompt / decode attention with P V on bf16 pairs available (AVX512-BF16 tier and up).
#define KT_FLASH_BF16 1
#include "flash_attn_avx512.inc"
