// Kernel table for the "avx512vnni" ISA tier; flags come from CMakeLists.txt (set_source_files_properties).
#define KT_ISA_NS isa_avx512vnni
#define KT_TABLE_FN kernel_table_avx512vnni
#define KT_TABLE_NAME "avx512vnni"
#include "kernels_impl.inc"
