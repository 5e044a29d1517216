// mlxtoy kernels: the float32 loops over rows and spans (included by kernels.cpp and decode.cpp).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>  // the packed GEMVs' and packers' AVX2 forms (packed.h)
#define MLXTOY_AVX2 1
#endif

namespace mlxtoy {

namespace {

// Hot loops are compiled twice on x86-64: AVX2+FMA and baseline, picked at load time.
#ifdef MLXTOY_AVX2
#define HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HOT
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e^x for x <= 0 (or moderate x): Cody-Waite reduction to r in [-ln2/2, ln2/2], degree-6
// Taylor polynomial, times 2^n through the exponent bits (the same formula as fastmath._exp).
inline float poly_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  float t = x * 1.4426950408889634f + shifter;
  float n = t - shifter;
  float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// ---- row kernels ----------------------------------------------------------------------------

// A row's length up to its last unmasked (not -inf) bias entry: what lies past it is never read.
inline int64_t open_length(const float* bias, int64_t S) {
  while (S > 0 && bias[S - 1] == kNegInf) --S;
  return S;
}

// e^(v - m), exactly 0 where v is masked (-inf): computed for masked entries too, then dropped,
// so the loops around it have no branch
inline float masked_exp(float v, float m) {
  float e = poly_exp(v - m);
  return v == kNegInf ? 0.0f : e;
}

// A softmax row's maximum and 1 / sum: enough to compute its probabilities again from the scores.
struct RowStats {
  float m, inv;
};

// p = softmax(s + bias) over a row of length S whose `open_length` is len; masked (-inf) entries
// give exactly 0, entries past len are not read (s may be shorter) and set to 0. A row masked
// entirely is all zeros (stats m = -inf). p may be s.
HOT RowStats softmax_row(const float* s, const float* bias, float* p, int64_t S, int64_t len) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j] + bias[j]);
  if (m == kNegInf) {
    std::fill(p, p + S, 0.0f);
    return {m, 0.0f};
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < len; ++j) {
    float e = masked_exp(s[j] + bias[j], m);
    p[j] = e;
    sum += e;
  }
  float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) p[j] *= inv;
  std::fill(p + len, p + S, 0.0f);
  return {m, inv};
}

// softmax_row's p again from the same scores and its stats: the same bits, without the sums.
HOT void softmax_row_again(const float* s, const float* bias, float* p, int64_t S, int64_t len, RowStats st) {
  if (st.m == kNegInf) {
    std::fill(p, p + S, 0.0f);
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) p[j] = masked_exp(s[j] + bias[j], st.m) * st.inv;
  std::fill(p + len, p + S, 0.0f);
}

// ds = p * (dp - sum(p * dp)): the softmax's input gradient, for a row of p that is 0 past len
// (dp is not read there and ds set to 0). ds may be dp.
HOT void softmax_grad_row(const float* p, const float* dp, float* ds, int64_t S, int64_t len) {
  float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
  for (int64_t j = 0; j < len; ++j) delta += p[j] * dp[j];
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) ds[j] = p[j] * (dp[j] - delta);
  std::fill(ds + len, ds + S, 0.0f);
}

// ce = logsumexp(x) - x[target] and with d: d = softmax(x) - onehot(target), for logits laid out
// (V, C), one token per column (the output GEMM W @ h.T is the faster one that way round):
// columns [c0, c1). Each token's sum runs over the vocabulary in order, in double (a float sum
// over 49K terms loses ~1e-5 of the loss).
HOT void cross_entropy_columns(const float* x, const int32_t* t, float* ce, float* d, int64_t V, int64_t C,
                               int64_t c0, int64_t c1) {
  int64_t n = c1 - c0;
  std::vector<float> m(n, kNegInf), inv(n);
  std::vector<double> sum(n, 0.0);
  for (int64_t v = 0; v < V; ++v) {
    const float* row = x + v * C + c0;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) m[j] = std::max(m[j], row[j]);
  }
  for (int64_t v = 0; v < V; ++v) {
    const float* row = x + v * C + c0;
    float* drow = d ? d + v * C + c0 : nullptr;
    if (drow) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        float e = poly_exp(row[j] - m[j]);
        drow[j] = e;
        sum[j] += e;
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) sum[j] += poly_exp(row[j] - m[j]);
    }
  }
  // a target outside the vocabulary gives a NaN loss (the step's non-finite guard sees it)
  auto valid = [&](int64_t j) { return t[c0 + j] >= 0 && t[c0 + j] < V; };
  for (int64_t j = 0; j < n; ++j) {
    float picked = valid(j) ? x[t[c0 + j] * C + c0 + j] : std::numeric_limits<float>::quiet_NaN();
    ce[c0 + j] = m[j] + static_cast<float>(std::log(sum[j])) - picked;
    inv[j] = static_cast<float>(1.0 / sum[j]);
  }
  if (!d) return;
  for (int64_t v = 0; v < V; ++v) {
    float* drow = d + v * C + c0;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) drow[j] *= inv[j];
  }
  for (int64_t j = 0; j < n; ++j)
    if (valid(j)) d[t[c0 + j] * C + c0 + j] -= 1.0f;
}

HOT void rms_norm_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < D; ++j) ss += x[j] * x[j];
  float r = 1.0f / std::sqrt(ss / D + eps);
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) y[j] = w[j] * (x[j] * r);
}

// y = w * x * r with r = (mean(x^2) + eps)^-1/2:
// dx = r * w * g - x * r^3 * mean(x * w * g); dw += g * x * r.
HOT void rms_norm_grad_row(const float* x, const float* w, const float* g, float* dx, float* dw,
                           int64_t D, float eps) {
  float ss = 0.0f, xwg = 0.0f;
#pragma omp simd reduction(+ : ss, xwg)
  for (int64_t j = 0; j < D; ++j) {
    ss += x[j] * x[j];
    xwg += x[j] * w[j] * g[j];
  }
  float r = 1.0f / std::sqrt(ss / D + eps);
  float c = r * r * r * xwg / D;
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) {
    dx[j] = r * w[j] * g[j] - c * x[j];
    dw[j] += g[j] * x[j] * r;
  }
}

HOT void swiglu_span(const float* a, const float* b, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] / (1.0f + poly_exp(-a[i])) * b[i];
}

// y = silu(a) * b: da = g * b * s * (1 + a * (1 - s)) with s = sigmoid(a); db = g * silu(a).
HOT void swiglu_grad_span(const float* a, const float* b, const float* g, float* da, float* db, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float s = 1.0f / (1.0f + poly_exp(-a[i]));
    da[i] = g[i] * b[i] * s * (1.0f + a[i] * (1.0f - s));
    db[i] = g[i] * a[i] * s;
  }
}

// y[m, n] = sum_k x[m, k] * W[n, k] for rows n in [n0, n1). (Four rows at a time, as four
// reductions in one simd loop, measured 1.6x slower: gcc does not vectorize it as well. For one
// row, AVX2 with four rows of W a pass was slower too.)
#ifdef MLXTOY_AVX2
// whether the AVX-512 forms run here (the functions built with target("avx512f")):
// MLXTOY_KERNEL_AVX512=0 runs every kernel in the form an AVX2-only CPU takes (its tests run
// on an AVX-512 CPU too; comparisons of the two)
inline bool cpu_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         !(std::getenv("MLXTOY_KERNEL_AVX512") && std::strcmp(std::getenv("MLXTOY_KERNEL_AVX512"), "0") == 0);
  return ok;
}

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

// gemv_span with AVX-512: R rows of W against MR rows of x a pass, each W vector loaded once for
// the MR rows and each x vector once for the R rows: R * MR independent FMA chains (one chain's
// latency bounded a row's loop; a batch of decoded tokens was bound by loading W's vectors again
// for every row of x). Each chain is the one a row of x alone takes, in the same order, so a row
// of a batch gets the bits it gets decoded alone. The k tail is masked. ahead: W's next R rows
// are prefetched line by line meanwhile (the first pass over a block of W's rows: its products,
// and the passes after it, hide the next block's misses).
template <int R, int MR, bool ahead = false>
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
  if constexpr (R >= 4 && MR >= 2) {
    // the sums in tiles of 4 rows of W by 4 of x, zeros where fewer (a GQA group of 2 or 3 heads'
    // scores, K = 64: the chains' one-at-a-time reductions were most of the pass; the 6-row
    // streamed pass's last 2 rows)
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

// One row of x (decoding) takes W a row at a time: W is then read in one sequential stream, which
// the hardware prefetchers follow across rows, where several rows a pass are as many short
// streams (a small model's rows are 36 lines); a row's one chain is not the bound at memory
// speed (docs/performance.md, "W in one stream"). Each row's chain is the one it takes in fours,
// so its bits are unchanged. Several rows of x where W is streamed from memory take 6 rows of W a
// pass (24 accumulators of 32 registers), the next 6 prefetched during the first pass; where W
// is in cache (a packed matrix's rows unpacked, a row's keys), 4 (docs/performance.md, "A batch
// of rows against W from memory").
inline void gemv_span_avx512(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                             int64_t n1, bool streamed) {
  int64_t n = n0;
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

// whether the AVX2 forms run here (those built with target("avx2"), and with "fma" too)
inline bool cpu_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}

inline bool cpu_avx2_fma() {
  static const bool ok = cpu_avx2() && __builtin_cpu_supports("fma");
  return ok;
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
  int folded = 0;  // rows of x whose sums are stored
  if constexpr (R == 4 && MR >= 2) {
    // rows 0 and 1 of x: their 8 sums folded at once (sums8), the same tree as hsum8's
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

// RoPE's angles at position `pos`, as mx.fast.rope forms them: cs[2i], cs[2i + 1] = the cosine
// and sine of pos * inv_freqs[i], i < dims / 2 (a decoded row's, once for all its heads)
HOT void rope_angles(float pos, const float* inv_freqs, int64_t dims, float* cs) {
  for (int64_t i = 0; i < dims / 2; ++i) {
    const float theta = pos * inv_freqs[i];
    cs[2 * i] = std::cos(theta), cs[2 * i + 1] = std::sin(theta);
  }
}

// RoPE of one row x (length D) by the angles of `rope_angles`: the pair (i, i + dims/2)
// (traditional: (2i, 2i + 1)) turned by angle i; entries past dims are copied.
HOT void rope_turn(const float* x, float* y, int64_t D, int64_t dims, bool traditional, const float* cs) {
  int64_t half = dims / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c = cs[2 * i], s = cs[2 * i + 1];
    int64_t a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
    float x1 = x[a], x2 = x[b];
    y[a] = x1 * c - x2 * s;
    y[b] = x1 * s + x2 * c;
  }
  std::copy(x + dims, x + D, y + dims);
}

// RoPE of one row x at position `pos`
inline void rope_row(const float* x, float* y, int64_t D, int64_t dims, bool traditional, float pos,
                     const float* inv_freqs) {
  constexpr int64_t kOnStack = 512;
  float on_stack[kOnStack];
  std::vector<float> on_heap(dims > kOnStack ? dims : 0);
  float* cs = dims > kOnStack ? on_heap.data() : on_stack;
  rope_angles(pos, inv_freqs, dims, cs);
  rope_turn(x, y, D, dims, traditional, cs);
}

// AdamW without bias correction, in the order of mlx.optimizers.AdamW's ops, one rounding per op
// (no contraction into FMAs): m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2,
// p = p (1 - lr wd) - lr m / (sqrt(v) + eps), g first multiplied by grad_scale (gradient clipping)
// unless it is 1. ok == 0 keeps p, m and v.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
HOT void adamw_span(const float* p, const float* g, const float* m, const float* v, float* po, float* mo,
                    float* vo, int64_t n, const float* sc) {
  const float lr = sc[0], b1 = sc[2], c1 = sc[3], b2 = sc[4], c2 = sc[5], eps = sc[6], wd = sc[7], gs = sc[8];
  if (sc[1] == 0.0f) {  // a step that is not applied
    if (po != p) std::memcpy(po, p, n * sizeof(float));
    if (mo != m) std::memcpy(mo, m, n * sizeof(float));
    if (vo != v) std::memcpy(vo, v, n * sizeof(float));
    return;
  }
  const float decay = 1.0f - lr * wd;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float gi = gs == 1.0f ? g[i] : g[i] * gs;
    float mi = b1 * m[i] + c1 * gi;
    float vi = b2 * v[i] + c2 * (gi * gi);
    po[i] = p[i] * decay - (lr * mi) / (std::sqrt(vi) + eps);
    mo[i] = mi;
    vo[i] = vi;
  }
}

// The index of a row's largest entry, the first of equal ones (as mx.argmax and numpy); NaN
// entries are never taken (a row of NaN gives 0).
inline int64_t argmax_row_portable(const float* x, int64_t n) {
  int64_t best = 0;
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] > m) {
      m = x[i];
      best = i;
    }
  return best;
}

#ifdef MLXTOY_AVX2
// The same with AVX2: the maximum over four vectors of lanes (max(x, m) keeps m where x is NaN),
// then the first entry equal to it, eight at a time (the row is in cache by then).
__attribute__((target("avx2"))) inline int64_t argmax_row_avx2(const float* x, int64_t n) {
  __m256 m0 = _mm256_set1_ps(kNegInf), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    m2 = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), m2);
    m3 = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), m3);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  float m = kNegInf;
  for (float v : lanes) m = v > m ? v : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  if (m == kNegInf) return argmax_row_portable(x, n);  // nothing above -inf: the portable rule
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= n; i += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;
}
#endif

inline int64_t argmax_row(const float* x, int64_t n) {
#ifdef MLXTOY_AVX2
  if (cpu_avx2()) return argmax_row_avx2(x, n);
#endif
  return argmax_row_portable(x, n);
}

constexpr int64_t kSumBlock = 1 << 16;  // sum_squares' fixed blocks
constexpr int64_t kLseBlock = 1 << 13;  // logsumexp's fixed blocks of a row

// A block's (max, sum of e^(x - max)) for logsumexp, the sum in double; -inf entries add 0.
HOT void lse_block(const float* x, int64_t n, float* m_out, double* s_out) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  double s = 0.0;
  if (m != kNegInf) {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += masked_exp(x[i], m);
  }
  *m_out = m;
  *s_out = s;
}

HOT double sum_squares_span(const float* x, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * x[i];
  return acc;
}

// a GEMV's rows per chunk: about eight chunks per thread, at least 16 rows
int64_t gemv_chunk(int64_t N, int threads) {
  return std::max<int64_t>(16, N / (8 * std::max(threads, 1)));
}

// rows per parallel slice so one slice is at least ~16K elements of work
int64_t grain(int64_t row_len) {
  return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(row_len, 1));
}

}  // namespace

}  // namespace mlxtoy
