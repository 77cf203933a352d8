// A stack of equally shaped weight matrices [count, rows, cols] in one backend format, plus the
// load-time repacking for the packed backends (AMXInt8, AMXBF16, AMXInt4, AMXInt4_1).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels.h"
#include "thread_pool.h"

namespace kt {

// LlamafilePanels: Q4_K weights copied into 16-row panels of their own integers (the same bits
// as Llamafile, no per-call unpack); a weight of another type, or a tier without the panel
// kernel, is described as Llamafile (read in place).
enum class Backend : int { Llamafile = 0, AMXInt8 = 1, AMXBF16 = 2, AMXInt4 = 3, AMXInt4_1 = 4, LlamafilePanels = 5 };
constexpr int kNumBackends = 6;
const char* backend_name(Backend b);

// 64-byte aligned, grow-only buffer.
class AlignedBuf {
 public:
  AlignedBuf() = default;
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
  ~AlignedBuf();
  void* ensure(size_t bytes);  // contents are not preserved when it grows
  void* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Forward-pass scratch shared by every layer that runs on one pool.  A pool runs one layer at a
// time (CPUInfer serializes its tasks), so a long prompt costs one set of these buffers instead of
// one per layer (48 MoE layers at 4096 tokens kept ~19 GB of grow-only per-layer buffers).
enum ScratchSlot : int { kScrMoeXaG, kScrMoeXaU, kScrMoeH, kScrMoeHa, kScrMoeY, kScrLinXa, kScrLinY, kNumScratch };
AlignedBuf& pool_scratch(ThreadPool& pool, ScratchSlot slot);

struct ProjWeights {
  Backend backend = Backend::Llamafile;
  int src_type = 0;        // ggml type of the source weights
  int count = 0, rows = 0, cols = 0;
  int Kpad = 0;            // padded row length of the packed layout (== cols for llamafile)
  int rows_pad = 0;        // rows rounded up to 16 (packed)
  const uint8_t* base = nullptr;
  size_t mat_bytes = 0;    // bytes per matrix
  size_t row_bytes = 0;    // llamafile: bytes per source row
  const float* scales = nullptr;  // packed int8: [count][rows_pad]
  const int32_t* corr = nullptr;  // packed int8: [count][rows_pad/16][Kpad/128][16] = -128 * group row sums
  ActFmt act = ActFmt::F32;
  GemmFn gemm = nullptr;

  // Fill the weight side of GemmArgs for matrix e, rows [r0, r0+nr); r0 % 16 == 0 for packed.
  void setup(GemmArgs& g, int e, int r0, int nr) const;
};

// Validates the shape for the type (throws std::invalid_argument naming `what`) and describes
// the source stack.  For Llamafile the result points straight at `src` (zero copy).
ProjWeights describe_weights(Backend b, const void* src, int src_type, int count, int rows, int cols,
                             const std::string& what);
// Bytes a packed copy needs (0 for Llamafile).
size_t packed_bytes(const ProjWeights& p);
// Requantise/repack p's source into dst (packed_bytes(p) bytes, 64-aligned) in parallel on the
// pool and repoint p at it.
void pack_weights(ProjWeights& p, const void* src, uint8_t* dst, ThreadPool& pool);
// Point p at a packed copy made earlier by pack_weights (packed_bytes(p) bytes, 64-aligned, e.g. a
// mapped cache file), without reading it.
void adopt_packed(ProjWeights& p, const uint8_t* dst);
// A 64-bit checksum of n bytes (not cryptographic: it catches a torn or corrupted cache file), the
// same for any thread count; computed on the pool at memory speed.
uint64_t checksum_bytes(const uint8_t* data, size_t n, ThreadPool& pool);

}  // namespace kt
