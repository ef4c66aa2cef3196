// AVX-512 kernels: BF16 via _mm512_dpbf16_ps (AVX512-BF16), INT8/INT4 via _mm512_dpbusd_epi32 (AVX512-VNNI).
// This file alone is compiled with -mavx512{f,bw,vl,dq,bf16,vnni}; dispatch.cpp only calls it after cpuid +
// XGETBV confirm the CPU and OS support every one of them. No std:: templates here (see MatView).
#include <immintrin.h>

#include "moe_internal.h"

namespace kvp::moe {
namespace {

constexpr int kTokChunk = 64;     // token rows kept hot in L2 while a 4-row weight strip stays in L1
constexpr int kPrefetch = 32768;  // bytes ahead in the weight stream (decode)

// Decode (few tokens) streams each weight matrix once. A 4-row strip is contiguous, and so are the strips that
// follow it, so the tile prefetches one linear stream kPrefetch bytes ahead of what it reads, as many lines per
// step as it consumes: the next strip is already on its way when this one ends (a per-row prefetch would fetch
// past each row's end into rows already in flight). kPrefetch: 32 KiB measured best on this
// Zen 5 (1 thread, same-process A/B): vs 16 KiB bf16 -12% and int8 -9% decode time, int4 even; 64 KiB slower.
static inline void prefetch_lin(const uint8_t* strip, size_t off, int lines, size_t dist = kPrefetch) {
  const char* p = reinterpret_cast<const char*>(strip) + dist + off;
  for (int i = 0; i < lines; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T0);
}

// The per-row floats (scale, comp) of rows as far ahead as the weight prefetch reaches: they live in their own
// arrays, a second stream the hardware prefetcher follows poorly (perf showed int4 decode stalled on the scale
// operand of the per-group FMA; prefetching them cut int4 decode time 8-10%, same-process A/B). `per_row`
// floats per row, R rows.
static inline void prefetch_meta(const float* v, const MatView& w, int r, int R, int per_row) {
  const size_t ahead = kPrefetch / w.row_bytes;
  if (size_t(r) + ahead >= size_t(w.N)) return;
  const char* p = reinterpret_cast<const char*>(v + (r + ahead) * size_t(per_row));
  const int bytes = R * per_row * 4;
  for (int o = 0; o < bytes + 63; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
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
// pf: bytes ahead of this strip to prefetch, R lines per step. Decode: kPrefetch. Prefill: one strip, on a
// strip's first token tile only, so the next strip comes from DRAM while this one is computed. pf = 0 (prefill's
// later tiles): each row 256 bytes ahead, from L2 (bench/DeepSeek-V2-Lite T=512 prefill -4.5%/-8% time,
// same-process A/B; prefetching the token rows too measured no gain).
template <int NT, int R>
void bf16_tile(const MatView& w, int r, const ActRows& a, int t0, float* y, size_t ldy, size_t pf) {
  const uint16_t* wr[R];
  for (int j = 0; j < R; ++j) wr[j] = reinterpret_cast<const uint16_t*>(row_ptr(w, r + j));
  const uint16_t* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const uint16_t*>(a.rows[t0 + t]);
  __m512 acc[NT][R];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < R; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int k = 0; k < w.K; k += 32) {
    __m512bh wv[R];
    if (pf)
      prefetch_lin(row_ptr(w, r), 2 * R * size_t(k), R, pf);  // R rows x 64 bytes per step
    else  // later prefill tiles: the strip is cached, but 6 token rows streaming through L1 evict parts of it
      for (int j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + 256, _MM_HINT_T0);
    for (int j = 0; j < R; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);
    for (int t = 0; t < NT; ++t) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x[t] + k);
      for (int j = 0; j < R; ++j) acc[t][j] = _mm512_dpbf16_ps(acc[t][j], xv, wv[j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int q = 0; q < R; q += 4)
      _mm_storeu_ps(y + (t0 + t) * ldy + q, reduce4(acc[t][q], acc[t][q + 1], acc[t][q + 2], acc[t][q + 3]));
}

// ---- INT8: u8 activations x s8 weights, 64 per step; per-channel scale ----
template <int NT, int R>
void int8_tile(const MatView& w, int r, const ActRows& a, int t0, float* y, size_t ldy) {
  const uint8_t* wr[R];
  for (int j = 0; j < R; ++j) wr[j] = row_ptr(w, r + j);
  const uint8_t* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const uint8_t*>(a.rows[t0 + t]);
  __m512i acc[NT][R];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < R; ++j) acc[t][j] = _mm512_setzero_si512();
  for (int k = 0; k < w.K; k += 64) {
    __m512i wv[R];
    if (a.n <= 4) prefetch_lin(wr[0], R * k, R);
    for (int j = 0; j < R; ++j) wv[j] = _mm512_loadu_si512(wr[j] + k);
    for (int t = 0; t < NT; ++t) {
      __m512i xv = _mm512_loadu_si512(x[t] + k);
      for (int j = 0; j < R; ++j) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], xv, wv[j]);
    }
  }
  for (int q = 0; q < R; q += 4) {
    const __m128 comp = _mm_loadu_ps(w.comp + r + q), scale = _mm_loadu_ps(w.scale + r + q);
    for (int t = 0; t < NT; ++t) {
      const __m128 sum = reduce4(_mm512_cvtepi32_ps(acc[t][q]), _mm512_cvtepi32_ps(acc[t][q + 1]),
                                 _mm512_cvtepi32_ps(acc[t][q + 2]), _mm512_cvtepi32_ps(acc[t][q + 3]));
      const __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_sub_ps(sum, comp), scale), _mm_set1_ps(a.scale[t0 + t]));
      _mm_storeu_ps(y + (t0 + t) * ldy + q, v);
    }
  }
}

// Prefill order shared by every format: rows outer in 4-row strips (a strip stays in L1; 8-row strips measured
// slower for bf16 decode and no faster for int8), token tiles inner, tokens in L2-sized chunks. tile(j, t, n,
// first) computes strip rows j..j+3 for tokens [t, t + n), n <= NT (the last tile of a chunk takes the exact
// remainder); `first` marks the strip's first tile of the chunk.
template <int NT, class Tile>
void prefill_strips(const ActRows& a, int nrows, const Tile& tile) {
  for (int c0 = 0; c0 < a.n; c0 += kTokChunk) {
    const int c1 = a.n < c0 + kTokChunk ? a.n : c0 + kTokChunk;
    for (int j = 0; j < nrows; j += 4)
      for (int t = c0; t < c1; t += NT) tile(j, t, c1 - t < NT ? c1 - t : NT, t == c0);
  }
}

// INT8, 4 rows x exactly n (1..4) tokens. Decode runs one such tile per strip (all tokens in one pass over the
// weights); prefill runs 4-token tiles and an exact remainder.
void int8_rows_n(const MatView& w, int r, const ActRows& a, int t, int n, float* y, size_t ldy) {
  switch (n) {
    case 1: return int8_tile<1, 4>(w, r, a, t, y, ldy);
    case 2: return int8_tile<2, 4>(w, r, a, t, y, ldy);
    case 3: return int8_tile<3, 4>(w, r, a, t, y, ldy);
    default: return int8_tile<4, 4>(w, r, a, t, y, ldy);
  }
}

void gemm_int8(const MatView& w, int r0, int nrows, const ActRows& a, float* y, size_t ldy) {
  if (a.n <= 0) return;
  if (a.n <= 4) {
    for (int j = 0; j < nrows; j += 4) int8_rows_n(w, r0 + j, a, 0, a.n, y + j, ldy);
    return;
  }
  prefill_strips<4>(a, nrows, [&](int j, int t, int n, bool) { int8_rows_n(w, r0 + j, a, t, n, y + j, ldy); });
}

// ---- INT4: 64 weights per 32 packed bytes, one float scale per group ----
// Memory form (kvp_moe.h): two's complement nibbles, so `b & 0xF0` is 16 * q of the high nibble and
// `(b << 4) & 0xF0` (a 16-bit shift; the AND drops the bits that crossed bytes) is 16 * q of the low one, both
// exact s8 for dpbusd: three ALU ops per 64 packed bytes, no subtract, and the 1/16 goes into the epilogue.
// Groups of 128 (or any multiple) read 64 packed bytes = weights k..k+127 per step: the low nibbles hold
// [k, k+32) and [k+64, k+96), the high ones [k+32, k+64) and [k+96, k+128); int4_act stored the activations in
// that order, so both activation vectors are plain 64-byte loads. Group 64 reads one 32-byte block per step.
static inline void nibbles16(__m512i b, __m512i& lo, __m512i& hi) {
  const __m512i m = _mm512_set1_epi8(char(0xf0));
  hi = _mm512_and_si512(b, m);
  lo = _mm512_and_si512(_mm512_slli_epi16(b, 4), m);
}

// 4 (or fewer, zero-padded) 16-lane sums -> 4 floats.
static inline __m128 reduce_n(const __m512* v, int n) {
  const __m512 z = _mm512_setzero_ps();
  return reduce4(v[0], n > 1 ? v[1] : z, n > 2 ? v[2] : z, n > 3 ? v[3] : z);
}

// R rows x NT tokens. R * NT int accumulators live for one group, R * NT float ones for the row.
template <int NT, int R>
void int4_tile(const MatView& w, int r, const ActRows& a, int t0, float* y, size_t ldy) {
  const uint8_t* wr[R];
  for (int j = 0; j < R; ++j) wr[j] = row_ptr(w, r + j);
  const uint8_t* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const uint8_t*>(a.rows[t0 + t]);
  const int groups = w.K / w.group;
  const bool pf = a.n <= 4, pairs = w.group % 128 == 0;
  if (pf) prefetch_meta(w.scale, w, r, R, groups), prefetch_meta(w.comp, w, r, R, 1);
  __m512 facc[NT * R];
  for (int i = 0; i < NT * R; ++i) facc[i] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    __m512i acc[NT][R];
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < R; ++j) acc[t][j] = _mm512_setzero_si512();
    const int kend = (g + 1) * w.group;
    if (pairs) {
      for (int k = g * w.group; k < kend; k += 128) {
        __m512i lo[R], hi[R];
        if (pf) prefetch_lin(wr[0], size_t(R) * k / 2, R);  // R rows x 64 bytes per step
        for (int j = 0; j < R; ++j) nibbles16(_mm512_loadu_si512(wr[j] + k / 2), lo[j], hi[j]);
        for (int t = 0; t < NT; ++t) {
          const __m512i xlo = _mm512_loadu_si512(x[t] + k), xhi = _mm512_loadu_si512(x[t] + k + 64);
          for (int j = 0; j < R; ++j)
            acc[t][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[t][j], xlo, lo[j]), xhi, hi[j]);
        }
      }
    } else {
      for (int k = g * w.group; k < kend; k += 64) {
        __m512i wv[R];
        if (pf) prefetch_lin(wr[0], size_t(R) * k / 2, (R + 1) / 2);  // R rows x 32 bytes per step
        for (int j = 0; j < R; ++j) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + k / 2));
          const __m256i m = _mm256_set1_epi8(char(0xf0));
          wv[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(_mm256_slli_epi16(b, 4), m)),
                                     _mm256_and_si256(b, m), 1);
        }
        for (int t = 0; t < NT; ++t) {
          const __m512i xv = _mm512_loadu_si512(x[t] + k);
          for (int j = 0; j < R; ++j) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], xv, wv[j]);
        }
      }
    }
    for (int j = 0; j < R; ++j) {
      const __m512 s = _mm512_set1_ps(w.scale[size_t(r + j) * groups + g]);
      for (int t = 0; t < NT; ++t)
        facc[t * R + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][j]), s, facc[t * R + j]);
    }
  }
  // facc is 16 * (sum - comp / scale): y = (facc / 16 - comp) * activation scale.
  alignas(16) float out[NT * R + 3];
  for (int i = 0; i < NT * R; i += 4) _mm_store_ps(out + i, reduce_n(facc + i, NT * R - i));
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < R; ++j)
      y[(t0 + t) * ldy + j] = (out[t * R + j] * (1.f / 16) - w.comp[r + j]) * a.scale[t0 + t];
}

// INT4: decode picks the tile that covers all tokens in one pass over the strip (the weights are unpacked once):
// 4-row strips for 1-2 tokens, 2-row strips for 3-4 (4 x 4 would need 32 accumulators). Prefill: 4 rows x 2.
template <int NT, int R>
void int4_rows(const MatView& w, int r0, int nrows, const ActRows& a, int t, float* y, size_t ldy) {
  for (int j = 0; j < nrows; j += R) int4_tile<NT, R>(w, r0 + j, a, t, y + j, ldy);
}

void gemm_int4(const MatView& w, int r0, int nrows, const ActRows& a, float* y, size_t ldy) {
  switch (a.n) {
    case 0: return;
    case 1: return int4_rows<1, 4>(w, r0, nrows, a, 0, y, ldy);
    case 2: return int4_rows<2, 4>(w, r0, nrows, a, 0, y, ldy);
    case 3: return int4_rows<3, 2>(w, r0, nrows, a, 0, y, ldy);
    case 4: return int4_rows<4, 2>(w, r0, nrows, a, 0, y, ldy);
    default: break;
  }
  prefill_strips<2>(a, nrows, [&](int j, int t, int n, bool) {
    if (n == 2) int4_tile<2, 4>(w, r0 + j, a, t, y + j, ldy);
    else int4_tile<1, 4>(w, r0 + j, a, t, y + j, ldy);
  });
}

// Group 128+: swap bytes [32, 64) and [64, 96) of every 128-byte block (see int4_tile). Group 64: natural.
void int4_act(uint8_t* row, int K, int group) {
  if (group % 128) return;
  for (int k = 0; k < K; k += 128) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k + 32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k + 32),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k + 64)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k + 64), b);
  }
}

// BF16 tile of exactly `left` (< NT + 1) tokens.
template <int NT>
void bf16_tail(const MatView& w, int r, const ActRows& a, int t, int left, float* y, size_t ldy, size_t pf) {
  if constexpr (NT > 1) {
    if (left >= NT) return bf16_tile<NT, 4>(w, r, a, t, y, ldy, pf);
    return bf16_tail<NT - 1>(w, r, a, t, left, y, ldy, pf);
  } else {
    bf16_tile<1, 4>(w, r, a, t, y, ldy, pf);
  }
}

// BF16: decode (<= 4 tokens) runs one tile of all tokens per 4-row strip. Prefill runs 6-token tiles (24
// accumulators; 10 loads per 24 dot products instead of 8 per 16) and one exact-size tail tile, and prefetches
// the next strip during each strip's first tile. Measured on this CPU, 1 thread, DeepSeek-V2-Lite shape: prefill
// +10-20% over 4-token tiles with a 1-token tail and no prefill prefetch.
void gemm_bf16(const MatView& w, int r0, int nrows, const ActRows& a, float* y, size_t ldy) {
  constexpr int NT = 6;
  if (a.n <= 0) return;
  if (a.n <= 4) {
    for (int j = 0; j < nrows; j += 4) bf16_tail<4>(w, r0 + j, a, 0, a.n, y + j, ldy, kPrefetch);
    return;
  }
  const size_t strip = 4 * w.row_bytes;
  prefill_strips<NT>(a, nrows, [&](int j, int t, int n, bool first) {
    bf16_tail<NT>(w, r0 + j, a, t, n, y + j, ldy, first ? strip : 0);
  });
}

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

const Kernels kAvx512Kernels = {{gemm_bf16, gemm_int8, gemm_int4}, silu_mul, to_bf16, to_u8, int4_act};

}  // namespace kvp::moe
