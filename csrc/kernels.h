// Per-ISA compute kernels behind one function table.  `kernels()` (dispatch.cpp) is the single
// dispatch point: it picks the table for cpu_features.h's active_tier() once.
//
// Each table is built by compiling kernels_impl.inc under its own target flags
// (kern_scalar.cpp, kern_avx2.cpp, kern_avxvnni.cpp, kern_avx512.cpp, kern_avx512vnni.cpp, kern_avx512bf16.cpp); AMX tile kernels live
// in kern_amx.cpp and are only installed when active_tier() == AMX.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ggml_types.h"

namespace kt {

// Layout of one quantised/converted activation row (internal, not a ggml format).
enum class ActFmt : int {
  F32 = 0,     // Kpad floats
  BF16 = 1,    // Kpad bf16 (zero padded beyond K)
  Q8_32 = 2,   // int8 qs[Kpad] | float d[Kpad/32] | int32 sum[Kpad/32]    (per-32 symmetric)
  Q8_256 = 3,  // int8 qs[Kpad] | float d[Kpad/256] | int16 bsum[Kpad/16] | int16 bsum32[Kpad/32]
               // (per-256 symmetric, Q8_K-like; the VNNI-512 tier stores qs of each 128 as sub-blocks 0,2,1,3)
  I8_G128 = 4, // int8 qs[Kpad] | float d[Kpad/128] | int32 sum[Kpad/128]  (packed-int8 backend)
  U8_G128 = 5, // uint8 qs[Kpad] (= int8 q + 128) | float d[Kpad/128] | int32 sum[Kpad/128]
               // (packed-int8 backend on VNNI-512: u8 x s8 vpdpbusd, the +128 is undone by the
               // per-row/group weight sums stored next to the packed weights)
};
constexpr int kNumActFmt = 6;

// Name of an activation format ("q8_32", ...), for the kernel table report.
const char* act_fmt_name(ActFmt f);

// Bytes of one activation row with Kpad elements (rounded up to 64).
size_t act_row_bytes(ActFmt f, int Kpad);

// Packed (AMX-style, VNNI-friendly) weight layouts for the AMXInt8 / AMXBF16 backends.
// A matrix [N, K] is stored as ceil(N/16) panels of 16 rows; inside a panel, for each group of
// 4 (int8) / 2 (bf16) consecutive k, 16 rows x 4 bytes = 64 bytes.  One panel slice of 64 k
// (int8) or 32 k (bf16) is exactly one 16x64-byte AMX B tile.
constexpr int kPanelRows = 16;
constexpr int kI8Group = 128;        // K padding / activation-scale group for int8
constexpr int kBf16KAlign = 32;      // K padding for bf16

// Packed int4 layout (AMXInt4 symmetric, AMXInt4_1 with a per-group min).  Group size along K:
// 32, the block of the Q8_32 activation rows, so the integer dot of one weight group with one
// activation block is exact and scaled once (weight scale x activation scale; the min or the
// -8 zero point times the block's activation sum); per-32 scales also keep int4 error near
// Q4_0 / Q4_1 (per-128 groups roughly double it on Gaussian weights).  K is padded to 32.
// One panel (16 rows x Kpad): nibbles [Kpad/32][4][64 bytes] | fp16 d[Kpad/32][16] |
// (AMXInt4_1) fp16 m[Kpad/32][16].  In the 64-byte vector h of group g, byte 4r + j holds
// row r's q at k = 32g + 8h + j (low nibble) and k = 32g + 8h + 4 + j (high nibble), so one
// AND / shift yields two vpdpbusd-ready u8 vectors.  Weight = d * (q - 8), or d * q + m.
constexpr int kI4Group = 32;
inline size_t i4_panel_bytes(int Kpad, bool with_min) { return (with_min ? 10ull : 9ull) * Kpad; }

// Q4_K in panels of 16 rows (llamafile_panels backend): the blocks' own integers, rows
// interleaved; per panel and superblock of 256 k: qs [4][8][16 rows][4 bytes] (2048), scales and
// mins as bytes [8][16 rows] (128 + 128), d and dmin fp16 [16 rows] (32 + 32).  vnni512.inc.
constexpr size_t kQ4KPanelBlock = 2368;
inline size_t q4k_panel_bytes(int K) { return static_cast<size_t>(K / 256) * kQ4KPanelBlock; }

// C[t*ldc + r] = dot(weight row r, activation row t) for r < nr, t < nt.
struct GemmArgs {
  int K = 0;                         // logical row length
  int Kpad = 0;                      // padded row length (packed layouts; == K for llamafile)
  const uint8_t* W = nullptr;        // llamafile: first row; packed: first panel (row 0 of it)
  size_t w_row_bytes = 0;            // llamafile only
  const float* w_scale = nullptr;    // packed int8: per-row scales, indexed from row 0
  const int32_t* w_corr = nullptr;   // packed int8: -128 * sum of each row's int8 weights per 128-k group,
                                     // [panel][Kpad/128][16], from the first panel
  int nr = 0;                        // rows (packed: any; whole panels are computed, nr stored)
  int nr_avail = 0;                  // rows of this matrix from W on (>= nr): kernels may prefetch them
  const uint8_t* const* A = nullptr; // nt activation rows in the format of this weight
  int nt = 0;
  float* C = nullptr;
  size_t ldc = 0;
  const uint8_t* next = nullptr;     // what the caller reads next (the next call's first rows), or null:
  size_t next_bytes = 0;             // the prefill panels fetch it into L2 during their last row group
  float* tmp = nullptr;              // scratch, >= Kpad floats (+64) per call, 64-byte aligned
  size_t tmp_bytes = 0;              // bytes at tmp; >= kGemmPrefillTmp(Kpad) enables the
                                     // llamafile prefill paths (unpacked weight panels)
};
using GemmFn = void (*)(const GemmArgs&);
// The first row group (32 rows) of the llamafile matrix rows `n` describes, as GemmArgs::next
// of the call before it (nothing for the packed layouts, which prefetch their own panels).
inline void first_rows(const GemmArgs& n, const uint8_t** p, size_t* bytes) {
  *p = n.w_row_bytes ? n.W : nullptr;
  *bytes = n.w_row_bytes * static_cast<size_t>(n.nr < 32 ? n.nr : 32);
}
// Scratch (GemmArgs::tmp_bytes) that enables every prefill path for rows of Kpad elements.
inline size_t kGemmPrefillTmp(int Kpad) { return 80ull * Kpad + 256; }

struct KernelTable {
  const char* name = nullptr;
  // llamafile backend: activation format and GEMM per ggml weight type (nullptr = unsupported)
  ActFmt lf_act[kMaxGgmlType] = {};
  GemmFn lf_gemm[kMaxGgmlType] = {};
  // Name of the kernel that serves decode (T = 1) / prefill (many tokens) for each type
  // ("generic": dequantise the row to fp32, then dot).
  const char* lf_decode[kMaxGgmlType] = {};
  const char* lf_prefill[kMaxGgmlType] = {};
  // packed backends
  GemmFn packed_i8 = nullptr;
  ActFmt packed_i8_act = ActFmt::I8_G128;  // U8_G128 on the VNNI-512 tier
  GemmFn packed_bf16 = nullptr;
  ActFmt packed_bf16_act = ActFmt::F32;  // BF16 with AVX512-BF16/AMX, else F32
  GemmFn packed_i4 = nullptr;    // AMXInt4
  GemmFn packed_i4_1 = nullptr;  // AMXInt4_1
  ActFmt packed_i4_act = ActFmt::Q8_32;
  GemmFn panels_q4k = nullptr;   // llamafile_panels (Q4_K; other types stay llamafile); Q8_256 activations
  // Name of the kernel that serves decode / prefill for each packed backend (index Backend - 1:
  // AMXInt8, AMXBF16, AMXInt4, AMXInt4_1, llamafile_panels).
  const char* packed_decode[5] = {};
  const char* packed_prefill[5] = {};
  // x[K] fp32 -> one activation row (Kpad >= K, padding is zero)
  void (*quantize_act)(ActFmt f, const float* x, int K, int Kpad, uint8_t* dst) = nullptr;
  void (*dequant_row)(int type, const void* src, float* dst, int64_t n) = nullptr;
  // h[i] = act(g[i]) * u[i] for the gated activations (Activation enum in moe.h)
  void (*glu)(int act, const float* g, const float* u, float* h, int n, float alpha, float limit) = nullptr;
  void (*axpy)(float a, const float* x, float* y, int n) = nullptr;  // y += a*x
  void (*bf16_to_f32_row)(const uint16_t* x, float* y, int n) = nullptr;
  void (*f32_to_bf16_row)(const float* x, uint16_t* y, int n) = nullptr;
  // Probes for the benchmark: sum of n floats (read bandwidth) and a register-only peak loop
  // (kind 0 fp32 fma, 1 bf16 dot, 2 int8 dot) returning the number of flops/ops executed.
  float (*probe_read)(const float* p, size_t n) = nullptr;
  double (*probe_peak)(int kind, int64_t iters) = nullptr;
};

const KernelTable& kernels();

// Table factories (one per translation unit).
const KernelTable* kernel_table_scalar();
const KernelTable* kernel_table_avx2();
const KernelTable* kernel_table_avxvnni();
const KernelTable* kernel_table_avx512();
const KernelTable* kernel_table_avx512vnni();
const KernelTable* kernel_table_avx512bf16();
// AMX overrides (kern_amx.cpp); never called unless active_tier() == AMX.
// Each takes the avx512bf16 kernel for the same layout, which serves calls with few tokens.
GemmFn amx_gemm_i8(GemmFn vnni);
GemmFn amx_gemm_bf16(GemmFn vnni);
// Prefill of the llamafile types with AMX bf16 tiles (from a few dozen tokens per call).
void amx_llamafile_prefill(KernelTable& t);

}  // namespace kt
