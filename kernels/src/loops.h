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
#include <immintrin.h>  // the SIMD forms here and in gemv.h, packed.h, gemm.h, the quantized GEMVs
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

// IEEE half -> float, exactly (subnormals, infinities and NaN payloads as numpy converts them)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (man << 13));  // inf, NaN
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
  const float magnitude = static_cast<float>(man) * 5.9604644775390625e-08f;  // subnormal (or 0): man 2^-24
  return sign ? -magnitude : magnitude;
}

// whether d is a float16 value (its bits in h): a GGUF block's d, or a bias made of one
inline bool half_exact(float d, uint16_t& h) {
  const uint32_t bits = std::bit_cast<uint32_t>(d), sign = (bits >> 16) & 0x8000;
  const int exp = static_cast<int>((bits >> 23) & 0xFF) - 127 + 15;  // float16's biased exponent
  const uint32_t man = (bits & 0x7FFFFF) | 0x800000;
  if ((bits & 0x7FFFFFFF) == 0) h = static_cast<uint16_t>(sign);
  else if (exp >= 31 || exp < -10) return false;  // beyond float16's range, or below its least subnormal
  else if (exp > 0) h = static_cast<uint16_t>(sign | (exp << 10) | ((man >> 13) & 0x3FF));
  else h = static_cast<uint16_t>(sign | (man >> (14 - exp)));  // a subnormal float16
  return half_to_float(h) == d;  // (bits cut off: not a float16 value)
}


// poly_exp's range [-87, 88], as values the compiler cannot see. With the constants in view GCC
// splits a vectorized loop at the clamp and computes the clamped branch in every lane too: in
// swiglu that is a / (1 + e^87), a subnormal result and a microcode assist in every lane, 16x
// slower than the loop itself. Read once a loop (`exp_range()`); the same bits.
struct ExpRange {
  float lo, hi;
};
inline ExpRange exp_range() {
  static volatile float lo = -87.0f, hi = 88.0f;
  return {lo, hi};
}

// e^x for x <= 0 (or moderate x): Cody-Waite reduction to r in [-ln2/2, ln2/2], degree-6
// Taylor polynomial, times 2^n through the exponent bits (the same formula as fastmath._exp).
inline float poly_exp(float x, ExpRange range) {
  x = std::min(std::max(x, range.lo), range.hi);
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
inline float masked_exp(float v, float m, ExpRange range) {
  float e = poly_exp(v - m, range);
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
  const ExpRange range = exp_range();
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < len; ++j) {
    float e = masked_exp(s[j] + bias[j], m, range);
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
  const ExpRange range = exp_range();
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) p[j] = masked_exp(s[j] + bias[j], st.m, range) * st.inv;
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
  const ExpRange range = exp_range();
  for (int64_t v = 0; v < V; ++v) {
    const float* row = x + v * C + c0;
    float* drow = d ? d + v * C + c0 : nullptr;
    if (drow) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        float e = poly_exp(row[j] - m[j], range);
        drow[j] = e;
        sum[j] += e;
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) sum[j] += poly_exp(row[j] - m[j], range);
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
  const ExpRange range = exp_range();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] / (1.0f + poly_exp(-a[i], range)) * b[i];
}

// y = silu(a) * b: da = g * b * s * (1 + a * (1 - s)) with s = sigmoid(a); db = g * silu(a).
HOT void swiglu_grad_span(const float* a, const float* b, const float* g, float* da, float* db, int64_t n) {
  const ExpRange range = exp_range();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float s = 1.0f / (1.0f + poly_exp(-a[i], range));
    da[i] = g[i] * b[i] * s * (1.0f + a[i] * (1.0f - s));
    db[i] = g[i] * a[i] * s;
  }
}

#ifdef MLXTOY_AVX2
// whether the AVX-512 forms run here (the functions built with target("avx512f")):
// MLXTOY_KERNEL_AVX512=0 runs every kernel in the form an AVX2-only CPU takes (its tests run
// on an AVX-512 CPU too; comparisons of the two)
inline bool cpu_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         !(std::getenv("MLXTOY_KERNEL_AVX512") && std::strcmp(std::getenv("MLXTOY_KERNEL_AVX512"), "0") == 0);
  return ok;
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
#endif

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
    const ExpRange range = exp_range();
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += masked_exp(x[i], m, range);
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
