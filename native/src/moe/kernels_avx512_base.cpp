// The AVX512 tier without VNNI (Skylake-SP): F/BW/VL/DQ; bf16 widened to fp32 + FMA, int8/int4 on vpmaddubsw
// with the sign trick (exact). Compiled with -mavx512{f,bw,vl,dq} (CMakeLists.txt); kernels: kernels_avx512.inc.
#define KVP_MOE_VNNI 0
#define KVP_MOE_BF16 0
#define KVP_MOE_TABLE kAvx512BaseKernels
#include "kernels_avx512.inc"
