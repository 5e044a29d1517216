// mlxtoy kernels: the float32 GEMV, y = x W^T for a few rows of x (decoding, a batch of decoded
// rows, a token's attention scores), and the sums of its chains (included by kernels.cpp,
// attend.h, packed.h and the quantized GEMVs).
#pragma once

#include <cstdint>

#include "loops.h"  // HOT, MLXTOY_AVX2 (x86-64 intrinsics), cpu_avx512 and cpu_avx2_fma

namespace mlxtoy {

namespace {

// y[m, n] = sum_k x[m, k] * W[n, k] for rows n in [n0, n1). (Four rows at a time, as four
// reductions in one simd loop, measured 1.6x slower: gcc does not vectorize it as well. For one
// row, AVX2 with four rows of W a pass was slower too.)
#ifdef MLXTOY_AVX2
// The sum of v's 16 lanes as GCC's _mm512_reduce_add_ps pairs them (lane i with i + 8, then i + 4,
// i + 2, i + 1), written out so that sums16 below, which must match it bit for bit, does not
// depend on which compiler built the reduction.
__attribute__((target("avx512f"), always_inline)) inline float sum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, 0x4E));  // lanes 0 + 2, 1 + 3
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 0x55)));
}

// The sums of 16 vectors at once, each as sum16 pairs its lanes (the same bits): lane j of the
// result is the sum of v[4 (j % 4) + j / 4]. Four levels of folding two vectors into one replace
// 16 reductions of ~8 dependent steps each: a 4 x 4 block of the several-rows GEMV at K = 576
// spent ~8% of its time in its reductions.
__attribute__((target("avx512f"), always_inline)) inline __m512 sums16(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s i + (i + 8); lanes 8-15: v[2i + 1]'s
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // each 128-bit quarter: one vector's i + (i + 4)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // within quarters: 0 + 2, 1 + 3
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));  // 0 + 1
}

// y[m * N + r] = sum16(acc[r][m]): R rows of W's chains against MR rows of x, in tiles of 4 by 4
// folded at once (sums16), zeros where fewer (a GQA group of 2 or 3 heads' scores, K = 64: the
// chains' one-at-a-time reductions were most of the pass; the 6-row streamed pass's last 2 rows)
template <int R, int MR>
__attribute__((target("avx512f"), always_inline)) inline void store_sums_avx512(const __m512 (&acc)[R][MR], float* y,
                                                                               int64_t N) {
  if constexpr (R >= 4 && MR >= 2) {
    static_assert(R % 4 == 0 || R % 4 == 2, "a tile of 4 rows of W, or 2 at the end");
    const __m512 z = _mm512_setzero_ps();
    for (int r0 = 0; r0 < R; r0 += 4) {
      __m512 v[16];
      for (int r = 0; r < 4; ++r)
        for (int m = 0; m < 4; ++m) v[r * 4 + m] = r0 + r < R && m < MR ? acc[r0 + r][m] : z;
      const __m512 sums = sums16(v);  // lane 4 m + r: acc[r0 + r][m]'s sum
      for (int m = 0; m < MR; ++m) {
        const __m128 row = _mm512_extractf32x4_ps(sums, m);
        if (R - r0 >= 4) _mm_storeu_ps(y + m * N + r0, row);
        else _mm_storel_pi(reinterpret_cast<__m64*>(y + m * N + r0), row);
      }
    }
  } else {
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) y[m * N + r] = sum16(acc[r][m]);
  }
}

// gemv_span with AVX-512: R rows of W against MR rows of x a pass, each W vector loaded once for
// the MR rows and each x vector once for the R rows: R * MR independent FMA chains (one chain's
// latency bounded a row's loop; a batch of decoded tokens was bound by loading W's vectors again
// for every row of x). Each chain is the one a row of x alone takes, in the same order, so a row
// of a batch gets the bits it gets decoded alone. The k tail is masked. ahead: W's next R rows
// are prefetched line by line meanwhile (the first pass over a block of W's rows: its products,
// and the passes after it, hide the next block's misses). stream: each line of W is prefetched
// this many floats before it is read, across rows (one row of x reading W in one stream: two
// cores of an Intel Xeon read 13-15 GB/s with the hardware's prefetchers alone, 23-25 with a
// line 2 KB ahead, docs/performance.md).
template <int R, int MR, bool ahead = false, int stream = 0>
__attribute__((target("avx512f"))) inline void gemv_block_avx512(const float* x, const float* w, float* y, int64_t N,
                                                                 int64_t K) {
  __m512 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      if constexpr (ahead) _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * K + k), _MM_HINT_T0);
      if constexpr (stream > 0) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + stream), _MM_HINT_T0);
      const __m512 wv = _mm512_loadu_ps(w + r * K + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  if (k < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm512_maskz_loadu_ps(tail, x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(tail, w + r * K + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  store_sums_avx512<R, MR>(acc, y, N);
}

// R rows of W against every row of x, four at a time: the first pass reads W's rows (from memory
// where W is streamed: it then prefetches the next R, `ahead`), the others from L1
template <int R, bool ahead = false>
inline void gemv_rows_avx512(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  if (M >= 4) gemv_block_avx512<R, 4, ahead>(x, w, y, N, K), m = 4;
  for (; m + 4 <= M; m += 4) gemv_block_avx512<R, 4>(x + m * K, w, y + m * N, N, K);
  switch (M - m) {
    case 3: return m ? gemv_block_avx512<R, 3>(x + m * K, w, y + m * N, N, K)
                     : gemv_block_avx512<R, 3, ahead>(x, w, y, N, K);
    case 2: return m ? gemv_block_avx512<R, 2>(x + m * K, w, y + m * N, N, K)
                     : gemv_block_avx512<R, 2, ahead>(x, w, y, N, K);
    case 1: return gemv_block_avx512<R, 1>(x + m * K, w, y + m * N, N, K);
  }
}

constexpr int kStreamAhead = 512;  // floats (2 KB): a streamed W's lines prefetched this far ahead

// One row of x (decoding) takes W a row at a time: W is then read in one sequential stream, which
// the hardware prefetchers follow across rows, where several rows a pass are as many short
// streams (a small model's rows are 36 lines); a row's one chain is not the bound at memory
// speed (docs/performance.md, "W in one stream"), once each line is prefetched kStreamAhead
// ahead where W comes from memory. Each row's chain is the one it takes in fours, so its bits are
// unchanged. Several rows of x where W is streamed from memory take 6 rows of W a
// pass (24 accumulators of 32 registers), the next 6 prefetched during the first pass; where W
// is in cache (a packed matrix's rows unpacked, a row's keys), 4 (docs/performance.md, "A batch
// of rows against W from memory").
inline void gemv_span_avx512(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                             int64_t n1, bool streamed) {
  int64_t n = n0;
  if (M == 1 && streamed)
    for (; n < n1; ++n) gemv_block_avx512<1, 1, false, kStreamAhead>(x, w + n * K, y + n, N, K);
  if (M == 1)
    for (; n < n1; ++n) gemv_block_avx512<1, 1>(x, w + n * K, y + n, N, K);
  if (streamed)
    for (; n + 6 <= n1; n += 6) gemv_rows_avx512<6, true>(x, w + n * K, y + n, M, N, K);
  for (; n + 4 <= n1; n += 4) gemv_rows_avx512<4>(x, w + n * K, y + n, M, N, K);
  for (; n < n1; ++n) gemv_rows_avx512<1>(x, w + n * K, y + n, M, N, K);
}

// the sum of 8 lanes
__attribute__((target("avx2"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The sums of 8 vectors' lanes at once, lane j = hsum8(v[j]) to the bit (the same pairs: lane i
// with i + 4, then i + 2, then i + 1), where one at a time each takes its own shuffles and adds
__attribute__((target("avx2"), always_inline)) inline __m256 sums8(const __m256 v[8]) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: v[2i]'s i + (i + 4); lanes 4-7: v[2i + 1]'s
    a[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // within halves: 0 + 2, 1 + 3
    b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  // 0 + 1: lanes [v0, v2, v4, v6, v1, v3, v5, v7], put in order
  const __m256 c = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD));
  return _mm256_permutevar8x32_ps(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// y[m * N + r] = hsum8(acc[r][m]); with 4 rows of W, rows 0 and 1 of x's 8 sums folded at once
// (sums8, the same tree)
template <int R, int MR>
__attribute__((target("avx2"), always_inline)) inline void store_sums_avx2(const __m256 (&acc)[R][MR], float* y,
                                                                          int64_t N) {
  int folded = 0;  // rows of x whose sums are stored
  if constexpr (R == 4 && MR >= 2) {
    __m256 v[8];
    for (int m = 0; m < 2; ++m)
      for (int r = 0; r < 4; ++r) v[m * 4 + r] = acc[r][m];
    const __m256 sums = sums8(v);  // lane 4 m + r: acc[r][m]'s sum
    _mm_storeu_ps(y, _mm256_castps256_ps128(sums));
    _mm_storeu_ps(y + N, _mm256_extractf128_ps(sums, 1));
    folded = 2;
  }
  for (int m = folded; m < MR; ++m)
    for (int r = 0; r < R; ++r) y[m * N + r] = hsum8(acc[r][m]);
}

// R rows of W against MR rows of x with AVX2: each W vector loaded once for the MR rows and each
// x vector once for the R rows, R * MR independent FMA chains (a batch of decoded tokens: one
// row's loop is bound by the FMA latency, a few rows' by the loads unless they share them). The
// k tail is a masked load.
template <int R, int MR>
__attribute__((target("avx2,fma"))) inline void gemv_block_avx2(const float* x, const float* w, float* y,
                                                               int64_t N, int64_t K) {
  __m256 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      __m256 wv = _mm256_loadu_ps(w + r * K + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  if (k < K) {
    alignas(32) int32_t lanes[8];
    for (int i = 0; i < 8; ++i) lanes[i] = k + i < K ? -1 : 0;
    __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_maskload_ps(x + m * K + k, tail);
    for (int r = 0; r < R; ++r) {
      __m256 wv = _mm256_maskload_ps(w + r * K + k, tail);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  store_sums_avx2<R, MR>(acc, y, N);
}

// gemv_span with AVX2: four rows of W (one L1-resident block) against every row of x, three at a
// time, so W is read from memory once whatever the rows. A row of x sums in the same order
// wherever it sits among others, and alone (one 8-lane chain, then hsum8), so it gets the same
// bits in a batch as decoded alone; not the AVX-512 form's bits (a 16-lane chain), which an AVX2
// form reproduces only with twice the accumulators, slower on a batch (docs/performance.md).
template <int R>
inline void gemv_rows_avx2(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) gemv_block_avx2<R, 3>(x + m * K, w, y + m * N, N, K);
  if (M - m == 2) gemv_block_avx2<R, 2>(x + m * K, w, y + m * N, N, K);
  else if (M - m == 1) gemv_block_avx2<R, 1>(x + m * K, w, y + m * N, N, K);
}

inline void gemv_span_avx2(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                           int64_t n1) {
  int64_t n = n0;
  if (M == 1)  // W a row at a time, in one sequential stream; each row the chain it has among others
    for (; n < n1; ++n) gemv_block_avx2<1, 1>(x, w + n * K, y + n, N, K);
  for (; n + 4 <= n1; n += 4) gemv_rows_avx2<4>(x, w + n * K, y + n, M, N, K);
  for (; n < n1; ++n) gemv_rows_avx2<1>(x, w + n * K, y + n, M, N, K);
}
#endif

// streamed: W is read from memory (a float32 matrix), not from cache
HOT void gemv_span(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                   int64_t n0, int64_t n1, bool streamed = false) {
#ifdef MLXTOY_AVX2
  if (cpu_avx512()) return gemv_span_avx512(x, w, y, M, N, K, n0, n1, streamed);
  if (cpu_avx2_fma()) return gemv_span_avx2(x, w, y, M, N, K, n0, n1);
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * wr[k];
      y[m * N + n] = acc;
    }
  }
}

}  // namespace

}  // namespace mlxtoy
