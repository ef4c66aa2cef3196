// Weight quantization and packing (baseline ISA; runs once at load/convert time).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>

#include <sys/mman.h>
#include <stdexcept>

#include "moe_internal.h"

namespace kvp::moe {

size_t row_bytes(Format f, int K) {
  switch (f) {
    case Format::BF16: return size_t(K) * 2;
    case Format::INT8: return size_t(K);
    case Format::INT4: return size_t(K) / 2;
  }
  return 0;
}

Matrix::~Matrix() {
  if (owned) std::free(data);
}

size_t Matrix::data_bytes(Format f, int n, int k) { return (size_t(n) * kvp::moe::row_bytes(f, k) + 63) / 64 * 64; }

uint8_t* alloc_weights(size_t bytes) {
  // Not touched here: the first touch (by the owning subpool) places the pages on its NUMA node.
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t total = (bytes + align - 1) / align * align;
  uint8_t* p = static_cast<uint8_t*>(std::aligned_alloc(align, total));
  if (!p) throw std::bad_alloc();
  // A tail of at least 1 MiB gets its own huge page too (at most 1 MiB of it unused); a smaller tail stays on
  // 4 KiB pages. madvise is advisory: failure only means small pages.
  const size_t tail = bytes % kHuge;
  if (bytes >= kHuge) madvise(p, tail >= kHuge / 2 ? total : bytes - tail, MADV_HUGEPAGE);
  return p;
}

void Matrix::allocate(Format f, int n, int k, int g, uint8_t* at) {
  N = n, K = k, group = g, row_bytes = kvp::moe::row_bytes(f, k);
  if (owned) std::free(data);
  owned = at == nullptr;
  data = owned ? alloc_weights(data_bytes(f, n, k)) : at;
  scale.assign(f == Format::INT8 ? n : f == Format::INT4 ? size_t(n) * (k / g) : 0, 0.f);
  comp.assign(f == Format::BF16 ? 0 : n, 0.f);
}

MatView view(const Matrix& m) {
  return {m.data, m.row_bytes, m.scale.data(), m.comp.data(), m.N, m.K, m.group};
}

namespace {

float load(const void* src, bool bf16, size_t i) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(src)[i]) : static_cast<const float*>(src)[i];
}

float amax_of(const void* src, bool bf16, size_t lo, size_t hi) {
  float m = 0.f;
  for (size_t i = lo; i < hi; ++i) m = std::max(m, std::fabs(load(src, bf16, i)));
  return m;
}

int quant(float v, float inv, int lo, int hi) {
  return std::clamp(int(std::nearbyint(v * inv)), lo, hi);
}

}  // namespace

void quantize_row(Format f, const void* src, bool bf16, int K, int group, uint8_t* dst, float* scale) {
  if (f == Format::BF16) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int k = 0; k < K; ++k) d[k] = bf16 ? static_cast<const uint16_t*>(src)[k] : f32_to_bf16(load(src, false, k));
  } else if (f == Format::INT8) {
    const float m = amax_of(src, bf16, 0, K), s = m > 0 ? m / 127.f : 1.f;
    for (int k = 0; k < K; ++k) reinterpret_cast<int8_t*>(dst)[k] = int8_t(quant(load(src, bf16, k), 1.f / s, -127, 127));
    *scale = s;
  } else {
    for (int g = 0; g < K / group; ++g) {
      const float m = amax_of(src, bf16, size_t(g) * group, size_t(g + 1) * group), s = m > 0 ? m / 7.f : 1.f;
      scale[g] = s;
      for (int k = g * group; k < (g + 1) * group; ++k) {
        const uint8_t q = uint8_t(quant(load(src, bf16, k), 1.f / s, -8, 7) + 8);
        uint8_t& b = dst[(k / 64) * 32 + (k % 32)];
        b = (k % 64) < 32 ? uint8_t((b & 0xf0) | q) : uint8_t((b & 0x0f) | (q << 4));
      }
    }
  }
}

float comp_row(Format f, const uint8_t* row, const float* scale, int K, int group) {
  if (f == Format::INT8) {
    int64_t s = 0;
    for (int k = 0; k < K; ++k) s += reinterpret_cast<const int8_t*>(row)[k];
    return 128.f * float(s);
  }
  if (f == Format::INT4) {
    double total = 0;
    for (int g = 0; g < K / group; ++g) {
      int64_t s = 0;
      for (int k = g * group; k < (g + 1) * group; ++k) {
        const uint8_t b = row[(k / 64) * 32 + (k % 32)];
        s += ((k % 64) < 32 ? (b & 15) : (b >> 4)) - 8;
      }
      total += double(scale[g]) * double(s);
    }
    return float(128.0 * total);
  }
  return 0.f;
}

void int4_to_memory(uint8_t* row, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) row[i] ^= 0x88;
}

void quantize_act(Format f, const void* src, bool bf16, int K, void* dst, float* scale) {
  if (f == Format::BF16) {
    quantize_row(f, src, bf16, K, 0, static_cast<uint8_t*>(dst), nullptr);
    return;
  }
  const float m = amax_of(src, bf16, 0, K), s = m > 0 ? m / 127.f : 1.f, inv = 1.f / s;
  uint8_t* d = static_cast<uint8_t*>(dst);
  for (int k = 0; k < K; ++k) d[k] = uint8_t(quant(load(src, bf16, k), inv, -127, 127) + 128);
  *scale = s;
}

}  // namespace kvp::moe
