// Row quantizers for the GGUF converter: llama.cpp's non-imatrix reference searches for the
// K-quants (Q4_K, Q5_K, Q6_K), and IQ4_NL / IQ4_XS (least-squares scale search over the non-linear
// code book, no importance matrix), written for this project, run on n_threads threads over rows.
#pragma once

#include <cstdint>

namespace kt {

// true for the ggml types quantize_rows can write
bool quantize_rows_supported(int ggml_type);

// Quantize nrows rows of n_per_row float32 values (n_per_row a multiple of the type's block:
// 32 for IQ4_NL, 256 otherwise) at src into
// consecutive ggml blocks at dst.  Throws std::invalid_argument on an unsupported type or row size.
void quantize_rows(int ggml_type, const float* src, void* dst, int64_t nrows, int64_t n_per_row, int n_threads);

}  // namespace kt
