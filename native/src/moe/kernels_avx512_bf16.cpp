// The AVX512-BF16 tier (Cooper Lake, Sapphire Rapids, Zen 4/5): F/BW/VL/DQ + VNNI + BF16 dot products.
// Compiled with -mavx512{f,bw,vl,dq,vnni,bf16} (CMakeLists.txt); the kernels are kernels_avx512.inc.
#define KVP_MOE_VNNI 1
#define KVP_MOE_BF16 1
#define KVP_MOE_TABLE kAvx512Bf16Kernels
#include "kernels_avx512.inc"
