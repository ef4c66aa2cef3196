// Portable reference kernels: the baseline every CPU runs, and the oracle for the SIMD variants.
#include <cmath>

#include "moe_internal.h"

namespace kvp::moe {
namespace {

void gemm_bf16(const MatView& w, int r0, int nrows, const ActRows& a, float* y, size_t ldy) {
  for (int t = 0; t < a.n; ++t) {
    const uint16_t* x = static_cast<const uint16_t*>(a.rows[t]);
    for (int j = 0; j < nrows; ++j) {
      const uint16_t* wr = reinterpret_cast<const uint16_t*>(row_ptr(w, r0 + j));
      float s = 0.f;
      for (int k = 0; k < w.K; ++k) s += bf16_to_f32(x[k]) * bf16_to_f32(wr[k]);
      y[t * ldy + j] = s;
    }
  }
}

void gemm_int8(const MatView& w, int r0, int nrows, const ActRows& a, float* y, size_t ldy) {
  for (int t = 0; t < a.n; ++t) {
    const uint8_t* x = static_cast<const uint8_t*>(a.rows[t]);
    for (int j = 0; j < nrows; ++j) {
      const int8_t* wr = reinterpret_cast<const int8_t*>(row_ptr(w, r0 + j));
      int32_t acc = 0;
      for (int k = 0; k < w.K; ++k) acc += int32_t(x[k]) * wr[k];
      y[t * ldy + j] = (float(acc) - w.comp[r0 + j]) * w.scale[r0 + j] * a.scale[t];
    }
  }
}

inline int nibble(const uint8_t* row, int k) {  // memory form: two's complement nibbles
  const uint8_t b = row[(k / 64) * 32 + (k % 32)];
  return (k % 64) < 32 ? int8_t(uint8_t(b << 4)) >> 4 : int8_t(b) >> 4;
}

void gemm_int4(const MatView& w, int r0, int nrows, const ActRows& a, float* y, size_t ldy) {
  const int groups = w.K / w.group;
  for (int t = 0; t < a.n; ++t) {
    const uint8_t* x = static_cast<const uint8_t*>(a.rows[t]);
    for (int j = 0; j < nrows; ++j) {
      const uint8_t* wr = row_ptr(w, r0 + j);
      const float* sc = w.scale + size_t(r0 + j) * groups;
      float f = 0.f;
      for (int g = 0; g < groups; ++g) {
        int32_t acc = 0;
        for (int k = g * w.group; k < (g + 1) * w.group; ++k) acc += int32_t(x[k]) * nibble(wr, k);
        f += float(acc) * sc[g];
      }
      y[t * ldy + j] = (f - w.comp[r0 + j]) * a.scale[t];
    }
  }
}

}  // namespace

void silu_mul_scalar(const float* gate, const float* up, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

void to_bf16_scalar(const float* src, uint16_t* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

void to_u8_scalar(const float* src, uint8_t* dst, float* scale, int n) {
  quantize_act(Format::INT8, src, false, n, dst, scale);
}

const Kernels kScalarKernels = {{gemm_bf16, gemm_int8, gemm_int4}, silu_mul_scalar, to_bf16_scalar, to_u8_scalar,
                                  nullptr, {nullptr, nullptr, nullptr}};

}  // namespace kvp::moe
