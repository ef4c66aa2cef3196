// The AmxEmulated tier: kernels_amx.inc with the tile instructions done in scalar C++ (amx_emulate.h) and the
// AVX-512 tier (F/BW/VL/DQ + VNNI) for the rest, so CI tests the AMX tier's packing and tiling on CPUs without
// AMX. Tests only: slow, and never picked by auto (docs/kt.md).
#define KVP_AMX_EMULATE 1
#define KVP_AMX_TABLE kAmxEmuKernels
#define KVP_AMX_FALLBACK kAvx512Kernels
#include "kernels_amx.inc"
