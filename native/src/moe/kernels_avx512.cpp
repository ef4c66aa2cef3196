// AVX-512 kernels: BF16 via _mm512_dpbf16_ps (AVX512-BF16), INT8/INT4 via _mm512_dpbusd_epi32 (AVX512-VNNI).
// This file alone is compiled with -mavx512{f,bw,vl,dq,bf16,vnni}; dispatch.cpp only calls it after cpuid +
// XGETBV confirm the CPU and OS support every one of them. No std:: templates here (see MatView).
#include <immintrin.h>

#include "moe_internal.h"

namespace kvp::moe {
namespace {

constexpr int kTokChunk = 64;
constexpr int kPrefetch = 1024;  // bytes ahead in each weight row (decode)  // token rows kept hot in L2 while a 4-row weight strip stays in L1

// Decode (few tokens) streams each weight row once: fetch ahead of the hardware prefetcher.
static inline void prefetch_rows(const uint8_t* const* rows, int byte_off) {
  for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + byte_off + kPrefetch, _MM_HINT_T0);
}

// ---- BF16: 4 weight rows x NT tokens per tile, 32 bf16 per step ----
template <int NT>
void bf16_tile(const MatView& w, int r, const ActRows& a, int t0, float* y, size_t ldy) {
  const uint16_t* wr[4];
  for (int j = 0; j < 4; ++j) wr[j] = reinterpret_cast<const uint16_t*>(row_ptr(w, r + j));
  const uint16_t* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const uint16_t*>(a.rows[t0 + t]);
  __m512 acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int k = 0; k < w.K; k += 32) {
    __m512bh wv[4];
    if (a.n <= 4) prefetch_rows(reinterpret_cast<const uint8_t* const*>(wr), 2 * k);
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);
    for (int t = 0; t < NT; ++t) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x[t] + k);
      for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_dpbf16_ps(acc[t][j], xv, wv[j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) y[(t0 + t) * ldy + j] = _mm512_reduce_add_ps(acc[t][j]);
}

// ---- INT8: u8 activations x s8 weights, 64 per step; per-channel scale ----
template <int NT>
void int8_tile(const MatView& w, int r, const ActRows& a, int t0, float* y, size_t ldy) {
  const uint8_t* wr[4];
  for (int j = 0; j < 4; ++j) wr[j] = row_ptr(w, r + j);
  const uint8_t* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const uint8_t*>(a.rows[t0 + t]);
  __m512i acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_si512();
  for (int k = 0; k < w.K; k += 64) {
    __m512i wv[4];
    if (a.n <= 4) prefetch_rows(wr, k);
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(wr[j] + k);
    for (int t = 0; t < NT; ++t) {
      __m512i xv = _mm512_loadu_si512(x[t] + k);
      for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], xv, wv[j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j)
      y[(t0 + t) * ldy + j] =
          (float(_mm512_reduce_add_epi32(acc[t][j])) - w.comp[r + j]) * w.scale[r + j] * a.scale[t0 + t];
}

// ---- INT4: 64 weights per 32 packed bytes, one float scale per group ----
static inline __m512i unpack_int4(const uint8_t* p) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i lo = _mm256_and_si256(b, m), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
  __m512i v = _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
  return _mm512_sub_epi8(v, _mm512_set1_epi8(8));
}

template <int NT>
void int4_tile(const MatView& w, int r, const ActRows& a, int t0, float* y, size_t ldy) {
  const uint8_t* wr[4];
  for (int j = 0; j < 4; ++j) wr[j] = row_ptr(w, r + j);
  const uint8_t* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const uint8_t*>(a.rows[t0 + t]);
  const int groups = w.K / w.group;
  __m512 facc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) facc[t][j] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    __m512i acc[NT][4];
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_si512();
    for (int k = g * w.group; k < (g + 1) * w.group; k += 64) {
      __m512i wv[4];
      if (a.n <= 4 && (k & 127) == 0) prefetch_rows(wr, k / 2);
      for (int j = 0; j < 4; ++j) wv[j] = unpack_int4(wr[j] + k / 2);
      for (int t = 0; t < NT; ++t) {
        __m512i xv = _mm512_loadu_si512(x[t] + k);
        for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], xv, wv[j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      __m512 s = _mm512_set1_ps(w.scale[size_t(r + j) * groups + g]);
      for (int t = 0; t < NT; ++t) facc[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][j]), s, facc[t][j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j)
      y[(t0 + t) * ldy + j] = (_mm512_reduce_add_ps(facc[t][j]) - w.comp[r + j]) * a.scale[t0 + t];
}

// Rows outer (a 4-row strip stays in L1), token tiles inner; tokens in L2-sized chunks.
template <template <int> class Tile, int MaxNT>
void gemm(const MatView& w, int r0, int nrows, const ActRows& a, float* y, size_t ldy) {
  for (int c0 = 0; c0 < a.n; c0 += kTokChunk) {
    const int c1 = a.n < c0 + kTokChunk ? a.n : c0 + kTokChunk;
    for (int j = 0; j < nrows; j += 4) {
      int t = c0;
      for (; t + MaxNT <= c1; t += MaxNT) Tile<MaxNT>::run(w, r0 + j, a, t, y + j, ldy);
      for (; t < c1; ++t) Tile<1>::run(w, r0 + j, a, t, y + j, ldy);
    }
  }
}

template <int NT> struct Bf16 { static void run(const MatView& w, int r, const ActRows& a, int t, float* y, size_t l) { bf16_tile<NT>(w, r, a, t, y, l); } };
template <int NT> struct Int8 { static void run(const MatView& w, int r, const ActRows& a, int t, float* y, size_t l) { int8_tile<NT>(w, r, a, t, y, l); } };
template <int NT> struct Int4 { static void run(const MatView& w, int r, const ActRows& a, int t, float* y, size_t l) { int4_tile<NT>(w, r, a, t, y, l); } };

}  // namespace

const Kernels kAvx512Kernels = {{gemm<Bf16, 4>, gemm<Int8, 4>, gemm<Int4, 2>}};

}  // namespace kvp::moe
