// mlxtoy kernels: the float32 loops over rows and spans (included by kernels.cpp and decode.cpp).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>  // the packed GEMVs' AVX2 forms
#endif

namespace mlxtoy {

namespace {

// Hot loops are compiled twice on x86-64: AVX2+FMA and baseline, picked at load time.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
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

// p = softmax(s + bias) over a row of length S; masked (-inf) entries give exactly 0, entries
// past the row's last unmasked one are not computed. Returns nothing; a row masked entirely
// is all zeros.
HOT void softmax_row(const float* s, const float* bias, float* p, int64_t S) {
  int64_t len = open_length(bias, S);
  float m = kNegInf;
  for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j] + bias[j]);
  if (m == kNegInf) {
    std::fill(p, p + S, 0.0f);
    return;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < len; ++j) {
    float v = s[j] + bias[j];
    float e = v == kNegInf ? 0.0f : poly_exp(v - m);
    p[j] = e;
    sum += e;
  }
  float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) p[j] *= inv;
  std::fill(p + len, p + S, 0.0f);
}

// ds = p * (dp - sum(p * dp)): the softmax's input gradient; p's zero tail is skipped.
HOT void softmax_grad_row(const float* p, const float* dp, float* ds, int64_t S) {
  int64_t len = S;
  while (len > 0 && p[len - 1] == 0.0f) --len;
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
// reductions in one simd loop, measured 1.6x slower: gcc does not vectorize it as well.)
HOT void gemv_span(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                   int64_t n0, int64_t n1) {
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

// One query row against the first `len` cached keys and values of its KV head:
// out = softmax(scale q.k + bias) v, bias (0 or -inf) optional (nullptr: none masked).
HOT void attend_row(const float* q, const float* k, const float* v, const float* bias, float* out, float* scores,
                    int64_t len, int64_t D, int64_t Dv, float scale) {
  float m = kNegInf;
  for (int64_t j = 0; j < len; ++j) {
    const float* kr = k + j * D;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kr[d];
    scores[j] = dot * scale + (bias ? bias[j] : 0.0f);
    m = std::max(m, scores[j]);
  }
  std::fill(out, out + Dv, 0.0f);
  if (m == kNegInf) return;  // every key masked: zeros, as the softmax kernel gives
  float sum = 0.0f;
  for (int64_t j = 0; j < len; ++j) {
    float e = scores[j] == kNegInf ? 0.0f : poly_exp(scores[j] - m);
    sum += e;
    if (e == 0.0f) continue;
    const float* vr = v + j * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) out[d] += e * vr[d];
  }
  float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t d = 0; d < Dv; ++d) out[d] *= inv;
}

// attend_row over S cached positions with a bias row: keys past the bias's last unmasked
// position are not read (the cache's unused capacity).
inline void decode_attention_row(const float* q, const float* k, const float* v, const float* bias, float* out,
                                 float* scores, int64_t S, int64_t D, int64_t Dv, float scale) {
  attend_row(q, k, v, bias, out, scores, open_length(bias, S), D, Dv, scale);
}

// RoPE of one row x (length D) at position `pos`, as mx.fast.rope computes it: the pair (i, i + dims/2)
// (traditional: (2i, 2i + 1)) turned by the angle pos * inv_freqs[i]; entries past dims are copied.
HOT void rope_row(const float* x, float* y, int64_t D, int64_t dims, bool traditional, float pos,
                  const float* inv_freqs) {
  int64_t half = dims / 2;
  for (int64_t i = 0; i < half; ++i) {
    float theta = pos * inv_freqs[i];
    float c = std::cos(theta), s = std::sin(theta);
    int64_t a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
    float x1 = x[a], x2 = x[b];
    y[a] = x1 * c - x2 * s;
    y[b] = x1 * s + x2 * c;
  }
  std::copy(x + dims, x + D, y + dims);
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

constexpr int64_t kSumBlock = 1 << 16;  // sum_squares' fixed blocks
constexpr int64_t kLseBlock = 1 << 13;  // logsumexp's fixed blocks of a row

// A block's (max, sum of e^(x - max)) for logsumexp, the sum in double; -inf entries add 0.
HOT void lse_block(const float* x, int64_t n, float* m_out, double* s_out) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  double s = 0.0;
  if (m != kNegInf) {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += x[i] == kNegInf ? 0.0f : poly_exp(x[i] - m);
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

// ---- lossless 4-bit weights ------------------------------------------------------------------
// A row of weights that are all of the form d * q + m (q in 0..15) per block of 32, as a Q4_1
// GGUF dequantizes to, kept as (d, m, 16 bytes of nibbles: element j in the low nibble of byte
// j, element j + 16 in the high one): decoding reads 0.75 bytes a weight instead of 4.
struct Q4Block {
  float d, m;
  uint8_t qs[16];
};
static_assert(sizeof(Q4Block) == 24, "Q4Block is 24 bytes");
constexpr int64_t kQ4 = 32;  // weights per block

// Packs a row of K (a multiple of 32) weights; false where any weight is not exactly
// fl(fl(d * q) + m) for the block's d = (max - min) / 15 and m = min (gguf-py's dequantization
// in float32, one rounding per op): then the row is not a 4-bit grid and must stay float32.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
inline bool pack_q4_row(const float* w, int64_t K, Q4Block* out) {
  for (int64_t b = 0; b < K / kQ4; ++b) {
    const float* x = w + b * kQ4;
    float lo = x[0], hi = x[0];
    for (int j = 1; j < kQ4; ++j) {
      lo = std::min(lo, x[j]);
      hi = std::max(hi, x[j]);
    }
    if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
    Q4Block& blk = out[b];
    blk.m = lo;
    blk.d = (hi - lo) / 15.0f;
    // the quantizer's d was rounded to float16: try the float32 quotient's neighbours too
    bool ok = false;
    for (float d : {blk.d, std::nextafter(blk.d, 0.0f), std::nextafter(blk.d, 1e30f)}) {
      ok = true;
      for (int j = 0; j < kQ4 && ok; ++j) {
        float q = d > 0.0f ? std::nearbyint((x[j] - lo) / d) : 0.0f;
        q = std::min(std::max(q, 0.0f), 15.0f);
        float back = d * q;
        back = back + lo;
        ok = back == x[j];
        uint8_t nib = static_cast<uint8_t>(q);
        if (j < 16) blk.qs[j] = nib;
        else blk.qs[j - 16] = static_cast<uint8_t>(blk.qs[j - 16] | (nib << 4));
      }
      if (ok) {
        blk.d = d;
        break;
      }
    }
    if (!ok) return false;
  }
  return true;
}

// xs[b] = the sum of x over block b (the m terms of a Q4 row's dot product)
inline void block_sums(const float* x, int64_t K, float* xs) {
  for (int64_t b = 0; b < K / kQ4; ++b) {
    float s = 0.0f;
    for (int j = 0; j < kQ4; ++j) s += x[b * kQ4 + j];
    xs[b] = s;
  }
}

// y[n] = sum_k x[k] * W[n, k] for rows n in [n0, n1) of a Q4-packed W (K / 32 blocks a row), as
// sum over blocks of d * (x . q) + m * xs[block]
inline void gemv_q4_span_portable(const float* x, const float* xs, const Q4Block* w, float* y, int64_t K,
                                  int64_t n0, int64_t n1) {
  const int64_t nb = K / kQ4;
  for (int64_t n = n0; n < n1; ++n) {
    const Q4Block* row = w + n * nb;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const Q4Block& blk = row[b];
      const float* xb = x + b * kQ4;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int j = 0; j < 16; ++j)
        dot += xb[j] * static_cast<float>(blk.qs[j] & 15) + xb[j + 16] * static_cast<float>(blk.qs[j] >> 4);
      acc += blk.d * dot + blk.m * xs[b];
    }
    y[n] = acc;
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The same with AVX2: the nibbles widened to 8 floats at a time, d * (x . q) kept in 8 lanes
// across the row's blocks, the m terms summed apart.
__attribute__((target("avx2,fma"))) inline void gemv_q4_span_avx2(const float* x, const float* xs, const Q4Block* w,
                                                                  float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = K / kQ4;
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t n = n0; n < n1; ++n) {
    const Q4Block* row = w + n * nb;
    __m256 acc = _mm256_setzero_ps();
    float macc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const Q4Block& blk = row[b];
      const float* xb = x + b * kQ4;
      __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
      __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
      __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(xb), q0);
      dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q1, dot);
      dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q2, dot);
      dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q3, dot);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(blk.d), dot, acc);
      macc += blk.m * xs[b];
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    y[n] = _mm_cvtss_f32(s) + macc;
  }
}

inline void gemv_q4_span(const float* x, const float* xs, const Q4Block* w, float* y, int64_t K, int64_t n0,
                         int64_t n1) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) gemv_q4_span_avx2(x, xs, w, y, K, n0, n1);
  else gemv_q4_span_portable(x, xs, w, y, K, n0, n1);
}
#else
inline void gemv_q4_span(const float* x, const float* xs, const Q4Block* w, float* y, int64_t K, int64_t n0,
                         int64_t n1) {
  gemv_q4_span_portable(x, xs, w, y, K, n0, n1);
}
#endif

// ---- lossless 8-bit weights ------------------------------------------------------------------
// A row of weights that are all d * q (q in -127..127) per block of 32, as a Q8_0 GGUF
// dequantizes to: (d, 32 signed bytes), 1.125 bytes a weight.
struct Q8Block {
  float d;
  int8_t qs[32];
};
static_assert(sizeof(Q8Block) == 36, "Q8Block is 36 bytes");

// Packs a row of K (a multiple of 32) weights; false where any weight is not exactly
// fl(d * q) for the block's d = absmax / 127 (or a float32 neighbour of it).
inline bool pack_q8_row(const float* w, int64_t K, Q8Block* out) {
  for (int64_t b = 0; b < K / kQ4; ++b) {
    const float* x = w + b * kQ4;
    float amax = 0.0f;
    for (int j = 0; j < kQ4; ++j) amax = std::max(amax, std::fabs(x[j]));
    if (!std::isfinite(amax)) return false;
    Q8Block& blk = out[b];
    float d0 = amax / 127.0f;
    bool ok = false;
    for (float d : {d0, std::nextafter(d0, 0.0f), std::nextafter(d0, 1e30f)}) {
      ok = true;
      for (int j = 0; j < kQ4 && ok; ++j) {
        float q = d > 0.0f ? std::nearbyint(x[j] / d) : 0.0f;
        q = std::min(std::max(q, -127.0f), 127.0f);
        ok = d * q == x[j];
        blk.qs[j] = static_cast<int8_t>(q);
      }
      if (ok) {
        blk.d = d;
        break;
      }
    }
    if (!ok) return false;
  }
  return true;
}

inline void gemv_q8_span_portable(const float* x, const Q8Block* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = K / kQ4;
  for (int64_t n = n0; n < n1; ++n) {
    const Q8Block* row = w + n * nb;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * kQ4;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int j = 0; j < 32; ++j) dot += xb[j] * static_cast<float>(row[b].qs[j]);
      acc += row[b].d * dot;
    }
    y[n] = acc;
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) inline void gemv_q8_span_avx2(const float* x, const Q8Block* w, float* y,
                                                                  int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = K / kQ4;
  for (int64_t n = n0; n < n1; ++n) {
    const Q8Block* row = w + n * nb;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * kQ4;
      const int8_t* qs = row[b].qs;
      __m256 dot = _mm256_setzero_ps();
      for (int j = 0; j < 32; j += 8) {
        __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + j));
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + j), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), dot);
      }
      acc = _mm256_fmadd_ps(_mm256_set1_ps(row[b].d), dot, acc);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    y[n] = _mm_cvtss_f32(s);
  }
}

inline void gemv_q8_span(const float* x, const Q8Block* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) gemv_q8_span_avx2(x, w, y, K, n0, n1);
  else gemv_q8_span_portable(x, w, y, K, n0, n1);
}
#else
inline void gemv_q8_span(const float* x, const Q8Block* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  gemv_q8_span_portable(x, w, y, K, n0, n1);
}
#endif

// The bytes of a packed row of K weights: Q4 blocks or Q8 blocks (distinct sizes, so a packed
// array's width says which); -1 for neither.
inline int64_t packed_width(int64_t K, int bits) {
  if (K % kQ4 != 0) return -1;
  return K / kQ4 * static_cast<int64_t>(bits == 4 ? sizeof(Q4Block) : sizeof(Q8Block));
}

// A weight matrix (N, K) in float32, Q4- or Q8-packed; rows(n) is the matrix from row n on.
struct Matrix {
  const float* f32;
  const Q4Block* q4;
  const Q8Block* q8;
  int64_t K;

  Matrix rows(int64_t n) const {
    int64_t nb = K / kQ4;
    return Matrix{f32 ? f32 + n * K : nullptr, q4 ? q4 + n * nb : nullptr, q8 ? q8 + n * nb : nullptr, K};
  }
  // y[n] for n in [n0, n1) of x times this matrix's rows; xs: x's block sums (Q4 only)
  void gemv(const float* x, const float* xs, float* y, int64_t n0, int64_t n1) const {
    if (q4) gemv_q4_span(x, xs, q4, y, K, n0, n1);
    else if (q8) gemv_q8_span(x, q8, y, K, n0, n1);
    else gemv_span(x, f32, y, 1, n1, K, n0, n1);
  }
};

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
