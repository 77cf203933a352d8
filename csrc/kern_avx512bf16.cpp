// Kernel table for the "avx512bf16" ISA tier; flags come from CMakeLists.txt (set_source_files_properties).
#define KT_ISA_NS isa_avx512bf16
#define KT_TABLE_FN kernel_table_avx512bf16
#define KT_TABLE_NAME "avx512bf16"
#include "kernels_impl.inc"
