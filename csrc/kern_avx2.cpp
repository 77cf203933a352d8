// Kernel table for the "avx2" ISA tier; flags come from CMakeLists.txt (set_source_files_properties).
#define KT_ISA_NS isa_avx2
#define KT_TABLE_FN kernel_table_avx2
#define KT_TABLE_NAME "avx2"
#include "kernels_impl.inc"
