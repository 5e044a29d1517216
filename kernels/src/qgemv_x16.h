// The 4-bit GEMV's integer form for AVX2 CPUs without AVX-512 VNNI (Zen 1-3, Intel client cores):
// x rounded to 16 bits per group of 32, as the VNNI form rounds it (the same bound: half a step of
// max|x_g| / kX16), and each group's 32 products summed in integers by `vpmaddwd`. The float form
// widens every weight to float32 (four zero-extends and four conversions for 32 weights, then an
// FMA per vector and row of x); here 32 weights take two zero-extends to 16 bits and two
// multiply-adds, and one conversion a group.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "loops.h"

namespace mlxtoy {

constexpr float kX16 = 32639.0f;  // the largest |x16| whose high byte stays within a signed byte (VNNI's split)

// x (M, K) rounded to 16 bits per group of 32, in the order the nibbles hold the weights: each
// group's 16 even elements (the low nibbles), then its 16 odd ones (the high); xsc (M, K / 32):
// each group's step (max|x_g| / kX16)
inline void round_x16(const float* x, int64_t M, int64_t K, int16_t* x16, float* xsc) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / 32; ++g) {
      const float* xg = x + m * K + g * 32;
      float amax = 0.0f;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xg[k]));
      const float step = amax > 0.0f ? amax / kX16 : 1.0f, inv = 1.0f / step;
      int16_t* out = x16 + m * K + g * 32;
      for (int j = 0; j < 16; ++j) {
        out[j] = static_cast<int16_t>(std::lrintf(std::clamp(xg[2 * j] * inv, -kX16, kX16)));
        out[16 + j] = static_cast<int16_t>(std::lrintf(std::clamp(xg[2 * j + 1] * inv, -kX16, kX16)));
      }
      xsc[m * (K / 32) + g] = step;
    }
}

#ifdef MLXTOY_AVX2
// rows [n0, n1) of y (M, N) = x W^T, W 4-bit in groups of 32 with its scales and biases already
// float32 (sc, bi: (n1 - n0, K / 32)); x16, xsc: round_x16's; xs: x's group sums (M, K / 32),
// which the biases multiply. Two accumulators a row of x (alternate groups).
// one group's 32 products with each row of x, as floats scaled by the weights' and x's steps
template <int M>
__attribute__((target("avx2,fma"))) inline void group_x16(const __m128i* q, const int16_t* x16, const float* xsc,
                                                          const float* s, int64_t K, int64_t g, __m256* acc) {
  const __m128i low4 = _mm_set1_epi8(15), v = _mm_loadu_si128(q + g);
  const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(v, low4));
  const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low4));
  for (int m = 0; m < M; ++m) {
    auto xg = reinterpret_cast<const __m256i*>(x16 + m * K + g * 32);
    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(xg)),
                                         _mm256_madd_epi16(hi, _mm256_loadu_si256(xg + 1)));
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[g] * xsc[m * (K / 32) + g]), acc[m]);
  }
}

// rows [n0, n1) of y (M, N) = x W^T, W 4-bit in groups of 32 with its scales and biases already
// float32 (sc, bi: (n1 - n0, K / 32)); x16, xsc: round_x16's; xs: x's group sums (M, K / 32),
// which the biases multiply. Two accumulators a row of x: even and odd groups.
template <int M>
__attribute__((target("avx2,fma"))) void qgemv4_rows_x16(const int16_t* x16, const float* xsc, const float* xs,
                                                         const uint32_t* w, const float* sc, const float* bi,
                                                         float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t groups = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    auto q = reinterpret_cast<const __m128i*>(w + n * (K / 8));
    const float* s = sc + (n - n0) * groups;
    const float* b = bi + (n - n0) * groups;
    __m256 even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      group_x16<M>(q, x16, xsc, s, K, g, even);
      group_x16<M>(q, x16, xsc, s, K, g + 1, odd);
    }
    if (g < groups) group_x16<M>(q, x16, xsc, s, K, g, even);
    for (int m = 0; m < M; ++m) {
      const float* xsm = xs + m * groups;
      __m256 bias = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + 8 <= groups; k += 8) bias = _mm256_fmadd_ps(_mm256_loadu_ps(b + k), _mm256_loadu_ps(xsm + k), bias);
      float tail = 0.0f;
      for (; k < groups; ++k) tail += b[k] * xsm[k];
      y[m * N + n] = hsum8(_mm256_add_ps(_mm256_add_ps(even[m], odd[m]), bias)) + tail;
    }
  }
}

inline void qgemv4_span_x16(int64_t M, const int16_t* x16, const float* xsc, const float* xs, const uint32_t* w,
                            const float* sc, const float* bi, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return qgemv4_rows_x16<1>(x16, xsc, xs, w, sc, bi, y, N, K, n0, n1);
    case 2: return qgemv4_rows_x16<2>(x16, xsc, xs, w, sc, bi, y, N, K, n0, n1);
    case 3: return qgemv4_rows_x16<3>(x16, xsc, xs, w, sc, bi, y, N, K, n0, n1);
    default: return qgemv4_rows_x16<4>(x16, xsc, xs, w, sc, bi, y, N, K, n0, n1);
  }
}
#endif

}  // namespace mlxtoy
