// Kernel table for the "avxvnni" ISA tier (the AVX2 kernels with 256-bit VEX vpdpbusd / vpdpwssd);
// flags come from CMakeLists.txt (set_source_files_properties).
#define KT_ISA_NS isa_avxvnni
#define KT_TABLE_FN kernel_table_avxvnni
#define KT_TABLE_NAME "avxvnni"
#include "kernels_impl.inc"
