// Kernel table for the "scalar" ISA tier; flags come from CMakeLists.txt (set_source_files_properties).
#define KT_ISA_NS isa_scalar
#define KT_TABLE_FN kernel_table_scalar
#define KT_TABLE_NAME "scalar"
#include "kernels_impl.inc"
