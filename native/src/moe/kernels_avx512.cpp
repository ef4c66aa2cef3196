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

// The 16-lane sums of 4 accumulators as one 4-float vector (a transpose-and-add, ~13 ops instead of ~32).
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d01 = _mm512_castps_pd(x01), d23 = _mm512_castps_pd(x23);
  const __m512 y = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  const __m256 z = _mm256_add_ps(_mm512_castps512_ps256(y),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
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
  for (int t = 0; t < NT; ++t) _mm_storeu_ps(y + (t0 + t) * ldy, reduce4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]));
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
  const __m128 comp = _mm_loadu_ps(w.comp + r), scale = _mm_loadu_ps(w.scale + r);
  for (int t = 0; t < NT; ++t) {
    const __m128 sum = reduce4(_mm512_cvtepi32_ps(acc[t][0]), _mm512_cvtepi32_ps(acc[t][1]),
                               _mm512_cvtepi32_ps(acc[t][2]), _mm512_cvtepi32_ps(acc[t][3]));
    const __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_sub_ps(sum, comp), scale), _mm_set1_ps(a.scale[t0 + t]));
    _mm_storeu_ps(y + (t0 + t) * ldy, v);
  }
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
  const __m128 comp = _mm_loadu_ps(w.comp + r);
  for (int t = 0; t < NT; ++t) {
    const __m128 sum = reduce4(facc[t][0], facc[t][1], facc[t][2], facc[t][3]);
    _mm_storeu_ps(y + (t0 + t) * ldy, _mm_mul_ps(_mm_sub_ps(sum, comp), _mm_set1_ps(a.scale[t0 + t])));
  }
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

// exp(x) as 2^n * 2^f, f in [-0.5, 0.5], degree-6 polynomial (rel. error ~1e-7 over the clamped range).
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718056f));  // f * ln2
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

void silu_mul(const float* gate, const float* up, float* out, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
  }
  if (i < n) silu_mul_scalar(gate + i, up + i, out + i, n - i);
}

void to_bf16(const float* src, uint16_t* dst, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  if (i < n) to_bf16_scalar(src + i, dst + i, n - i);
}

// Same rounding as quantize_act (nearest, ties to even; |q| <= 127, + 128); n is a multiple of 64.
void to_u8(const float* src, uint8_t* dst, float* scale, int n) {
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(src + i)));
  const float amax = _mm512_reduce_max_ps(m), s = amax > 0 ? amax / 127.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / s);
  const __m512i off = _mm512_set1_epi32(128), lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int i = 0; i < n; i += 16) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + i), inv));  // MXCSR default: nearest-even
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(q));
  }
  *scale = s;
}

}  // namespace

const Kernels kAvx512Kernels = {{gemm<Bf16, 4>, gemm<Int8, 4>, gemm<Int4, 2>}, silu_mul, to_bf16, to_u8};

}  // namespace kvp::moe
