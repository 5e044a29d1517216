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

#include "gemv.h"  // hsum8
#include "loops.h"
#include "qgemv.h"

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
// the first n of 8 floats at p (n < 8: the rest 0, nothing past them read)
__attribute__((target("avx2"))) inline __m256 load8(const float* p, int64_t n) {
  if (n == 8) return _mm256_loadu_ps(p);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
}

// 8 scales or biases of type T at p + i as float32 (n < 8: the first n, the rest 0, nothing past
// them read). The short form takes no copy through memory: that was a call, around which every
// vector register of the loop was spilled (as in the VNNI form's load4_tail)
template <ScaleType T>
__attribute__((target("avx2,f16c"))) inline __m256 load8(const void* p, int64_t i, int64_t n = 8) {
  if constexpr (T == ScaleType::F32) return load8(static_cast<const float*>(p) + i, n);
  const uint16_t* at = static_cast<const uint16_t*>(p) + i;
  __m128i h;
  if (n == 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
  } else {
    h = _mm_setzero_si128();
    switch (n) {
      case 7: h = _mm_insert_epi16(h, at[6], 6); [[fallthrough]];
      case 6: h = _mm_insert_epi16(h, at[5], 5); [[fallthrough]];
      case 5: h = _mm_insert_epi16(h, at[4], 4); [[fallthrough]];
      case 4: h = _mm_insert_epi16(h, at[3], 3); [[fallthrough]];
      case 3: h = _mm_insert_epi16(h, at[2], 2); [[fallthrough]];
      case 2: h = _mm_insert_epi16(h, at[1], 1); [[fallthrough]];
      case 1: h = _mm_insert_epi16(h, at[0], 0);
    }
  }
  if constexpr (T == ScaleType::F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Rows [n0, n1) of y (M, N) = x W^T, W 4-bit in groups of 32 with scales and biases (N, K / 32)
// of type T read as they are, 8 groups at a time; x16, xsc: round_x16's; xs: x's group sums
// (M, K / 32), which the biases multiply (Sym: a Q4_0 block's, -8 scales, are not read). Two accumulators a row of x (even and odd groups). W's
// bytes are prefetched kX16AheadBytes before they are read, rows being contiguous: without, the
// loop kept too few misses in flight for the hardware's prefetch (as in the float form's
// kAheadPasses); a distance in bytes rather than rows suits every K (Zen 3, two threads, in a
// standalone copy of the loop: 26 -> 29-33 G weights/s for 8192 x 2048 and 2048 x 8192).
constexpr int64_t kX16AheadBytes = 2048;

// `count` groups' products (Count: the same, known when compiled) with each row of x: group h's
// int32 dot as float, times its step (lane h of step[m]), into even[m] or odd[m]
template <int M, int Count>
__attribute__((target("avx2,fma"), always_inline)) inline void x16_groups(const __m128i* q, const int16_t* x16,
                                                                        int64_t K, int64_t count, const __m256* step,
                                                                        __m256* even, __m256* odd) {
  const __m128i low4 = _mm_set1_epi8(15);
#pragma GCC unroll 8
  for (int h = 0; h < (Count ? Count : count); ++h) {
    const __m128i v = _mm_loadu_si128(q + h);
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(v, low4));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low4));
    const __m256i lane = _mm256_set1_epi32(h);
    for (int m = 0; m < M; ++m) {
      auto xg = reinterpret_cast<const __m256i*>(x16 + m * K + h * 32);
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(xg)),
                                                             _mm256_madd_epi16(hi, _mm256_loadu_si256(xg + 1))));
      const __m256 sg = _mm256_permutevar8x32_ps(step[m], lane);
      if (h & 1) odd[m] = _mm256_fmadd_ps(dot, sg, odd[m]);
      else even[m] = _mm256_fmadd_ps(dot, sg, even[m]);
    }
  }
}

template <int M, ScaleType T, bool Sym>
__attribute__((target("avx2,fma,f16c"))) void qgemv4_rows_x16(const int16_t* x16, const float* xsc, const float* xs,
                                                              const uint32_t* w, const void* scales,
                                                              const void* biases, float* y, int64_t N, int64_t K,
                                                              int64_t n0, int64_t n1) {
  const int64_t groups = K / 32;
  const char* end = reinterpret_cast<const char*>(w + N * (K / 8));
  for (int64_t n = n0; n < n1; ++n) {
    auto q = reinterpret_cast<const __m128i*>(w + n * (K / 8));
    __m256 even[M], odd[M], bias[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = bias[m] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
      const int64_t count = std::min<int64_t>(8, groups - g0);
      const char* ahead = reinterpret_cast<const char*>(q + g0) + kX16AheadBytes;  // 8 groups: 2 lines
      if (ahead + 64 < end) _mm_prefetch(ahead, _MM_HINT_T0), _mm_prefetch(ahead + 64, _MM_HINT_T0);
      const __m256 s8 = load8<T>(scales, n * groups + g0, count);
      const __m256 b8 = Sym ? _mm256_mul_ps(s8, _mm256_set1_ps(-8.0f)) : load8<T>(biases, n * groups + g0, count);
      __m256 step[M];  // each group's weight step times x's
      for (int m = 0; m < M; ++m) {
        step[m] = _mm256_mul_ps(s8, load8(xsc + m * groups + g0, count));
        bias[m] = _mm256_fmadd_ps(b8, load8(xs + m * groups + g0, count), bias[m]);
      }
      if (count == 8) x16_groups<M, 8>(q + g0, x16 + g0 * 32, K, 8, step, even, odd);
      else x16_groups<M, 0>(q + g0, x16 + g0 * 32, K, count, step, even, odd);
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = hsum8(_mm256_add_ps(_mm256_add_ps(even[m], odd[m]), bias[m]));
  }
}

template <ScaleType T, bool Sym>
inline void qgemv4_span_x16(int64_t M, const int16_t* x16, const float* xsc, const float* xs, const uint32_t* w,
                            const void* scales, const void* biases, float* y, int64_t N, int64_t K, int64_t n0,
                            int64_t n1) {
  switch (M) {
    case 1: return qgemv4_rows_x16<1, T, Sym>(x16, xsc, xs, w, scales, biases, y, N, K, n0, n1);
    case 2: return qgemv4_rows_x16<2, T, Sym>(x16, xsc, xs, w, scales, biases, y, N, K, n0, n1);
    case 3: return qgemv4_rows_x16<3, T, Sym>(x16, xsc, xs, w, scales, biases, y, N, K, n0, n1);
    default: return qgemv4_rows_x16<4, T, Sym>(x16, xsc, xs, w, scales, biases, y, N, K, n0, n1);
  }
}

// qgemv4_span_x16 for the scales' type st at run time
template <bool Sym>
inline void qgemv4_x16(ScaleType st, int64_t M, const int16_t* x16, const float* xsc, const float* xs,
                            const uint32_t* w, const void* scales, const void* biases, float* y, int64_t N, int64_t K,
                            int64_t n0, int64_t n1) {
  if (st == ScaleType::F16) return qgemv4_span_x16<ScaleType::F16, Sym>(M, x16, xsc, xs, w, scales, biases, y, N, K, n0, n1);
  if (st == ScaleType::BF16) return qgemv4_span_x16<ScaleType::BF16, Sym>(M, x16, xsc, xs, w, scales, biases, y, N, K, n0, n1);
  qgemv4_span_x16<ScaleType::F32, Sym>(M, x16, xsc, xs, w, scales, biases, y, N, K, n0, n1);
}
#endif

}  // namespace mlxtoy
