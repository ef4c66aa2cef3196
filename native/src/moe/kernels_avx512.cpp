// The AVX512 tier without AVX512-BF16 (Ice Lake, Cascade Lake): F/BW/VL/DQ + VNNI; bf16 widened to fp32 + FMA.
// Compiled with -mavx512{f,bw,vl,dq,vnni} only (CMakeLists.txt); the kernels are kernels_avx512.inc.
#define KVP_MOE_VNNI 1
#define KVP_MOE_BF16 0
#define KVP_MOE_TABLE kAvx512Kernels
#include "kernels_avx512.inc"
