// Internal helpers shared by the MoE translation units (not a public header).
#pragma once
#include <cstdint>
#include <cstring>

#include "kvp_moe.h"

namespace kvp::moe {

static inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

static inline const uint8_t* row_ptr(const MatView& w, int r) { return w.data + size_t(r) * w.row_bytes; }

// Per-ISA kernel tables; each lives in its own translation unit compiled with its own target flags.
extern const Kernels kScalarKernels;
extern const Kernels kAvx2Kernels;
extern const Kernels kAvx512BaseKernels;  // F/BW/VL/DQ, no VNNI (int8/int4 on vpmaddubsw, bf16 widened to fp32)
extern const Kernels kAvx512Kernels;      // F/BW/VL/DQ + VNNI (bf16 widened to fp32)
extern const Kernels kAvx512Bf16Kernels;  // the same + AVX512-BF16
extern const Kernels kAmxKernels;         // AMX tiles for prefill; decode is kAvx512Bf16Kernels
extern const Kernels kAmxEmuKernels;      // the same code, tile instructions emulated (CI); rest kAvx512Kernels
void silu_mul_scalar(const float* gate, const float* up, float* out, int n);
void to_bf16_scalar(const float* src, uint16_t* dst, int n);
void to_u8_scalar(const float* src, uint8_t* dst, float* scale, int n);

}  // namespace kvp::moe
