// The AMX tier (Sapphire Rapids and newer): AMX-BF16/INT8 tiles for prefill, the AVX512-BF16 tier for the rest.
// Compiled with -mamx-{tile,bf16,int8} and the AVX512-BF16 tier's flags (CMakeLists.txt); dispatch.cpp calls it
// only after cpuid, XGETBV and the kernel's permission for tile data (arch_prctl). Kernels: kernels_amx.inc.
#define KVP_AMX_EMULATE 0
#define KVP_AMX_TABLE kAmxKernels
#define KVP_AMX_FALLBACK kAvx512Bf16Kernels
#include "kernels_amx.inc"
