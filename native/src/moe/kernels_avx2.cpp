// AVX2 + FMA fallbacks: BF16 widened to fp32 FMA; INT8/INT4 as exact s16 multiply-adds (_mm256_madd_epi16),
// so the integer paths give the same sums as the AVX-512 VNNI ones. Compiled with -mavx2 -mfma only.
#include <immintrin.h>

#include "moe_internal.h"

namespace kvp::moe {
namespace {

static inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

static inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

static inline __m256 load_bf16x8(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// 16 u8 activations x 16 s8 weights -> 8 int32 partial sums (exact).
static inline __m256i dot16(const uint8_t* x, __m128i w8) {
  __m256i xv = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_madd_epi16(xv, _mm256_cvtepi8_epi16(w8));
}

template <int NT>
void bf16_tile(const MatView& w, int r, const ActRows& a, int t0, float* y, size_t ldy) {
  const uint16_t* wr[4];
  for (int j = 0; j < 4; ++j) wr[j] = reinterpret_cast<const uint16_t*>(row_ptr(w, r + j));
  __m256 acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm256_setzero_ps();
  for (int k = 0; k < w.K; k += 8) {
    __m256 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = load_bf16x8(wr[j] + k);
    for (int t = 0; t < NT; ++t) {
      __m256 xv = load_bf16x8(static_cast<const uint16_t*>(a.rows[t0 + t]) + k);
      for (int j = 0; j < 4; ++j) acc[t][j] = _mm256_fmadd_ps(xv, wv[j], acc[t][j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) y[(t0 + t) * ldy + j] = hsum_ps(acc[t][j]);
}

template <int NT>
void int8_tile(const MatView& w, int r, const ActRows& a, int t0, float* y, size_t ldy) {
  __m256i acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm256_setzero_si256();
  for (int k = 0; k < w.K; k += 16) {
    for (int j = 0; j < 4; ++j) {
      __m128i wv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_ptr(w, r + j) + k));
      for (int t = 0; t < NT; ++t)
        acc[t][j] = _mm256_add_epi32(acc[t][j], dot16(static_cast<const uint8_t*>(a.rows[t0 + t]) + k, wv));
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j)
      y[(t0 + t) * ldy + j] = (float(hsum_epi32(acc[t][j])) - w.comp[r + j]) * w.scale[r + j] * a.scale[t0 + t];
}

// One 64-weight block of row `p` (32 packed bytes) against 64 u8 activations.
static inline __m256i dot64_int4(const uint8_t* x, const uint8_t* p) {
  const __m256i m = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8);
  // memory form (two's complement nibbles) back to q + 8: the s16 madd path wants small unsigned nibbles
  __m256i b = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(char(0x88)));
  __m256i lo = _mm256_sub_epi8(_mm256_and_si256(b, m), eight);                          // elements 0..31
  __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(b, 4), m), eight);    // elements 32..63
  __m256i s = dot16(x, _mm256_castsi256_si128(lo));
  s = _mm256_add_epi32(s, dot16(x + 16, _mm256_extracti128_si256(lo, 1)));
  s = _mm256_add_epi32(s, dot16(x + 32, _mm256_castsi256_si128(hi)));
  return _mm256_add_epi32(s, dot16(x + 48, _mm256_extracti128_si256(hi, 1)));
}

template <int NT>
void int4_tile(const MatView& w, int r, const ActRows& a, int t0, float* y, size_t ldy) {
  const int groups = w.K / w.group;
  for (int j = 0; j < 4; ++j) {
    const uint8_t* wr = row_ptr(w, r + j);
    const float* sc = w.scale + size_t(r + j) * groups;
    for (int t = 0; t < NT; ++t) {
      const uint8_t* x = static_cast<const uint8_t*>(a.rows[t0 + t]);
      __m256 f = _mm256_setzero_ps();
      for (int g = 0; g < groups; ++g) {
        __m256i acc = _mm256_setzero_si256();
        for (int k = g * w.group; k < (g + 1) * w.group; k += 64) acc = _mm256_add_epi32(acc, dot64_int4(x + k, wr + k / 2));
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(sc[g]), f);
      }
      y[(t0 + t) * ldy + j] = (hsum_ps(f) - w.comp[r + j]) * a.scale[t0 + t];
    }
  }
}

template <template <int> class Tile, int MaxNT>
void gemm(const MatView& w, int r0, int nrows, const ActRows& a, float* y, size_t ldy) {
  for (int j = 0; j < nrows; j += 4) {
    int t = 0;
    for (; t + MaxNT <= a.n; t += MaxNT) Tile<MaxNT>::run(w, r0 + j, a, t, y + j, ldy);
    for (; t < a.n; ++t) Tile<1>::run(w, r0 + j, a, t, y + j, ldy);
  }
}

template <int NT> struct Bf16 { static void run(const MatView& w, int r, const ActRows& a, int t, float* y, size_t l) { bf16_tile<NT>(w, r, a, t, y, l); } };
template <int NT> struct Int8 { static void run(const MatView& w, int r, const ActRows& a, int t, float* y, size_t l) { int8_tile<NT>(w, r, a, t, y, l); } };
template <int NT> struct Int4 { static void run(const MatView& w, int r, const ActRows& a, int t, float* y, size_t l) { int4_tile<NT>(w, r, a, t, y, l); } };

}  // namespace

const Kernels kAvx2Kernels = {{gemm<Bf16, 2>, gemm<Int8, 2>, gemm<Int4, 1>}, silu_mul_scalar, to_bf16_scalar,
                               to_u8_scalar, nullptr, {nullptr, nullptr, nullptr}};

}  // namespace kvp::moe
