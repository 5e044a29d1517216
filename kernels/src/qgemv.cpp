// The fused quantized GEMV of decoding (qgemv.h): each row of W's packed words read once and
// multiplied in registers, nothing dequantized to memory.

#include "qgemv.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gemv.h"  // hsum8
#include "loops.h"
#include "packed.h"
#include "qgemv_vnni.h"
#include "qgemv_x16.h"

namespace mlxtoy {

namespace {

// For a few rows of x (at most kGemvRows) the product is bound by reading W, so no slab is
// dequantized to memory: each row of packed words is read once, widened to float32 in
// registers and multiplied there, with the affine form split as
//   y[m, n] = sum_g scale[n, g] * (x_g . q_g) + bias[n, g] * sum(x_g)
// (x's sums over each group taken once per call). The scales and biases are read in their own
// dtype (float16 for a GGUF's blocks): a cast to float32 per call would write 8 bytes a group
// of every matrix on every token.

// Each line of W is prefetched two passes (of R rows) before the loop reads it: out of cache the
// loop's work per byte keeps too few misses in flight for the hardware's own prefetch (measured
// on a Zen 4, one thread, 8192 x 4096: 12.1 -> 15.6 G weights/s; in L3 ~19)
constexpr int64_t kAheadPasses = 2;

#ifdef MLXTOY_AVX2
__attribute__((target("avx2,f16c"))) inline int64_t f16_to_f32_f16c(const uint16_t* h, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  return i;
}
#endif

// n scales (or biases) of type t at p as float32
inline void scales_to_f32(const void* p, ScaleType t, float* out, int64_t n) {
  if (t == ScaleType::F32) {
    std::memcpy(out, p, n * sizeof(float));
    return;
  }
  auto h = static_cast<const uint16_t*>(p);
  int64_t i = 0;
#ifdef MLXTOY_AVX2
  static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (t == ScaleType::F16 && f16c) i = f16_to_f32_f16c(h, out, n);
#endif
  for (; i < n; ++i)
    out[i] = t == ScaleType::BF16 ? std::bit_cast<float>(static_cast<uint32_t>(h[i]) << 16) : half_to_float(h[i]);
}

// x (M, K) as the loops read it: at 4 bits each chunk of 32 with its even elements first, then
// its odd ones (the low and the high nibbles of the chunk's 16 bytes); at 8 bits as it is
inline void order_x(const float* x, float* xo, int64_t M, int64_t K, int bits) {
  if (bits == 8) {
    std::memcpy(xo, x, M * K * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < M * K; i += kChunk)
    for (int j = 0; j < kChunk / 2; ++j) {
      xo[i + j] = x[i + 2 * j];
      xo[i + kChunk / 2 + j] = x[i + 2 * j + 1];
    }
}

// rows [n0, n1) of y (M, N) = x W^T for rows of W (words a row) with its scales and biases
// already float32 (sc, bi: (n1 - n0, groups)); xo: order_x's x, xs: x's group sums (M, groups)
template <int M, int B>
void qgemv_rows_portable(const float* xo, const float* xs, const uint32_t* w, const float* sc, const float* bi,
                         float* y, int64_t N, int64_t K, int64_t group, int64_t n0, int64_t n1) {
  const int64_t words = K * B / 32, groups = K / group;
  for (int64_t n = n0; n < n1; ++n) {
    auto q = reinterpret_cast<const uint8_t*>(w + n * words);
    const float* s = sc + (n - n0) * groups;
    const float* b = bi + (n - n0) * groups;
    for (int m = 0; m < M; ++m) {
      const float* xm = xo + m * K;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.0f;
        for (int64_t c = g * group; c < (g + 1) * group; c += kChunk) {
          if (B == 4) {
            const uint8_t* qc = q + c / 2;
#pragma omp simd reduction(+ : dot)
            for (int j = 0; j < 16; ++j)
              dot += xm[c + j] * static_cast<float>(qc[j] & 15) + xm[c + 16 + j] * static_cast<float>(qc[j] >> 4);
          } else {
#pragma omp simd reduction(+ : dot)
            for (int j = 0; j < 32; ++j) dot += xm[c + j] * static_cast<float>(q[c + j]);
          }
        }
        acc += s[g] * dot + b[g] * xs[m * groups + g];
      }
      y[m * N + n] = acc;
    }
  }
}

#ifdef MLXTOY_AVX2
// The same with AVX-512: a chunk's 32 weights as two vectors of 16 floats (4 bits: the low
// nibbles, then the high ones), R rows of W a pass (independent chains and R streams of W in
// flight), each widened once for every row of x; each group's x . q kept in 16 lanes and scaled
// into the row's accumulator; the bias terms as one dot over the groups.
template <int M, int B, int R>
__attribute__((target("avx512f"))) inline void qgemv_pass_avx512(const float* xo, const float* xs,
                                                                 const uint8_t* q, const float* s, const float* b,
                                                                 float* y, int64_t N, int64_t K, int64_t group) {
  const int64_t groups = K / group, row_bytes = K * B / 8;
  const __m128i low4 = _mm_set1_epi8(15);
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dot[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) dot[r][m] = _mm512_setzero_ps();
    for (int64_t c = g * group; c < (g + 1) * group; c += kChunk) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* qr = q + r * row_bytes;
        if ((c * B / 8) % 64 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(qr + c * B / 8 + kAheadPasses * R * row_bytes), _MM_HINT_T0);
        __m512 lo, hi;
        if (B == 4) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + c / 2));
          lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low4)));
          hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4)));
        } else {
          lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + c))));
          hi = _mm512_cvtepi32_ps(
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + c + 16))));
        }
        for (int m = 0; m < M; ++m) {
          dot[r][m] = _mm512_fmadd_ps(_mm512_loadu_ps(xo + m * K + c), lo, dot[r][m]);
          dot[r][m] = _mm512_fmadd_ps(_mm512_loadu_ps(xo + m * K + c + 16), hi, dot[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sg = _mm512_set1_ps(s[r * groups + g]);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(sg, dot[r][m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      __m512 bacc = _mm512_setzero_ps();
      const float* br = b + r * groups;
      int64_t g = 0;
      for (; g + 16 <= groups; g += 16)
        bacc = _mm512_fmadd_ps(_mm512_loadu_ps(br + g), _mm512_loadu_ps(xs + m * groups + g), bacc);
      if (g < groups) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (groups - g)) - 1);
        bacc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, br + g), _mm512_maskz_loadu_ps(tail, xs + m * groups + g),
                               bacc);
      }
      y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]) + _mm512_reduce_add_ps(bacc);
    }
}

template <int M, int B>
__attribute__((target("avx512f"))) void qgemv_rows_avx512(const float* xo, const float* xs, const uint32_t* w,
                                                          const float* sc, const float* bi, float* y, int64_t N,
                                                          int64_t K, int64_t group, int64_t n0, int64_t n1) {
  // one row of x: 4 rows of W a pass (4 independent chains); more: 2 (2 M chains; with 1, M = 4
  // rows against W from cache, a batch's output layer, were bound by their 4 chains' latency)
  constexpr int R = M == 1 ? 4 : 2;
  const int64_t words = K * B / 32, groups = K / group;
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    qgemv_pass_avx512<M, B, R>(xo, xs, reinterpret_cast<const uint8_t*>(w + n * words), sc + (n - n0) * groups,
                               bi + (n - n0) * groups, y + n, N, K, group);
  for (; n < n1; ++n)
    qgemv_pass_avx512<M, B, 1>(xo, xs, reinterpret_cast<const uint8_t*>(w + n * words), sc + (n - n0) * groups,
                               bi + (n - n0) * groups, y + n, N, K, group);
}

// The same with AVX2 and FMA: 8 floats a vector, four to a chunk.
template <int M, int B>
__attribute__((target("avx2,fma"))) void qgemv_rows_avx2(const float* xo, const float* xs, const uint32_t* w,
                                                         const float* sc, const float* bi, float* y, int64_t N,
                                                         int64_t K, int64_t group, int64_t n0, int64_t n1) {
  const int64_t words = K * B / 32, groups = K / group;
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t n = n0; n < n1; ++n) {
    auto q = reinterpret_cast<const uint8_t*>(w + n * words);
    const float* s = sc + (n - n0) * groups;
    const float* b = bi + (n - n0) * groups;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 dot[M];
      for (int m = 0; m < M; ++m) dot[m] = _mm256_setzero_ps();
      for (int64_t c = g * group; c < (g + 1) * group; c += kChunk) {
        __m256 f[4];
        if (B == 4) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c / 2));
          const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
          f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
          f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
          f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
          f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        } else {
          for (int v = 0; v < 4; ++v)
            f[v] = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + c + 8 * v))));
        }
        for (int m = 0; m < M; ++m)
          for (int v = 0; v < 4; ++v) dot[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xo + m * K + c + 8 * v), f[v], dot[m]);
      }
      const __m256 sg = _mm256_set1_ps(s[g]);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(sg, dot[m], acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float bsum = 0.0f;
      for (int64_t g = 0; g < groups; ++g) bsum += b[g] * xs[m * groups + g];
      y[m * N + n] = hsum8(acc[m]) + bsum;
    }
  }
}
#endif

template <int M, int B>
void qgemv_rows(const float* xo, const float* xs, const uint32_t* w, const float* sc, const float* bi, float* y,
                int64_t N, int64_t K, int64_t group, int64_t n0, int64_t n1) {
#ifdef MLXTOY_AVX2
  if (cpu_avx512()) return qgemv_rows_avx512<M, B>(xo, xs, w, sc, bi, y, N, K, group, n0, n1);
  if (cpu_avx2_fma()) return qgemv_rows_avx2<M, B>(xo, xs, w, sc, bi, y, N, K, group, n0, n1);
#endif
  qgemv_rows_portable<M, B>(xo, xs, w, sc, bi, y, N, K, group, n0, n1);
}

// Rows [n0, n1) of W against M rows of x, kGemvRows rows of x a pass: past the first pass the
// block of W's rows is read from cache. Each output's sum is the one its row of x gets alone.
template <int B>
void qgemv_span(int64_t M, const float* xo, const float* xs, const uint32_t* w, const float* sc, const float* bi,
                float* y, int64_t N, int64_t K, int64_t group, int64_t n0, int64_t n1) {
  const int64_t groups = K / group;
  for (int64_t m = 0; m < M; m += kGemvRows) {
    const float *xm = xo + m * K, *xsm = xs + m * groups;
    float* ym = y + m * N;
    switch (std::min(M - m, kGemvRows)) {
      case 1: qgemv_rows<1, B>(xm, xsm, w, sc, bi, ym, N, K, group, n0, n1); break;
      case 2: qgemv_rows<2, B>(xm, xsm, w, sc, bi, ym, N, K, group, n0, n1); break;
      case 3: qgemv_rows<3, B>(xm, xsm, w, sc, bi, ym, N, K, group, n0, n1); break;
      default: qgemv_rows<4, B>(xm, xsm, w, sc, bi, ym, N, K, group, n0, n1);
    }
  }
}

// sums (M, K / group) of x (M, K) over each group
inline void group_sums(const float* x, int64_t M, int64_t K, int64_t group, float* sums) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / group; ++g) {
      float sum = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += x[m * K + k];
      sums[m * (K / group) + g] = sum;
    }
}

}  // namespace

// MLXTOY_KERNEL_VNNI=0: the float32 form instead of x rounded to 16 bits (tests, comparisons)
static bool x16_allowed() {
  static const bool ok = !(std::getenv("MLXTOY_KERNEL_VNNI") && std::string(std::getenv("MLXTOY_KERNEL_VNNI")) == "0");
  return ok;
}

bool cpu_vnni() {
#ifdef MLXTOY_AVX2
  static const bool ok = x16_allowed() && cpu_avx512() && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

bool vnni_form(int64_t K, int64_t group, int bits) {
  return (bits == 4 || bits == 8) && group == 32 && K % 32 == 0 && cpu_vnni();
}

// the AVX2 integer form (qgemv_x16.h) where the VNNI form does not run
static bool x16_form(int64_t K, int64_t group, int bits) {
  return bits == 4 && group == 32 && K % 32 == 0 && cpu_x16() && !vnni_form(K, group, bits);
}

int64_t gemv_max_rows(int64_t K, int64_t group, int bits) {
  return vnni_form(K, group, bits) ? kVnniMaxRows : x16_form(K, group, bits) ? kX16MaxRows : kFloatMaxRows;
}

bool cpu_x16() {
#ifdef MLXTOY_AVX2
  return x16_allowed() && cpu_avx2_fma() && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool integer_form(int64_t K, int64_t group, int bits) {
  return vnni_form(K, group, bits) || x16_form(K, group, bits);
}

void QuantRows::reserve(int64_t M, int64_t K, int bits) {
  vnni_ = vnni_form(K, 32, bits), K_ = K, bits_ = bits;
  sums_.resize(M * K / 32);
  steps_.resize(vnni_ ? 0 : M * K / 32), x16_.resize(vnni_ ? 0 : M * K);
  const int64_t blocks = vnni_blocks(K), lanes = vnni_lanes(bits);
  bytes_.resize(vnni_ ? M * blocks * 256 : 0), xsl_.resize(vnni_ ? M * blocks * lanes : 0);
  corr_.resize(vnni_ ? M * blocks * lanes : 0);
}

void QuantRows::prepare(const float* x, int64_t m0, int64_t m1) {
#ifdef MLXTOY_AVX2
  const int64_t K = K_, groups = K / 32;
  if (vnni_) {
    const int64_t blocks = vnni_blocks(K), lanes = vnni_lanes(bits_);
    vnni_x(x + m0 * K, m1 - m0, K, bits_, bytes_.data() + m0 * blocks * 256, xsl_.data() + m0 * blocks * lanes,
           corr_.data() + m0 * blocks * lanes, sums_.data() + m0 * groups);
    return;
  }
  round_x16(x + m0 * K, m1 - m0, K, x16_.data() + m0 * K, steps_.data() + m0 * groups);
  group_sums(x + m0 * K, m1 - m0, K, 32, sums_.data() + m0 * groups);
#endif
}

void QuantRows::span(int64_t M, const uint32_t* w, const void* scales, const void* biases, ScaleType st,
                     bool symmetric, float* y, int64_t N, int64_t n0, int64_t n1) const {
  constexpr int64_t kTileRows = 16;
  // A prompt's rows of x in passes of 4 (AVX2), or of 2 with VNNI, where a pass's vectors then
  // stay in registers (four spilled them: 20 against 17 ms for 32 rows of x and a 14336 x 4096
  // W, a Zen 4)
  const bool few = M <= kGemvRows;
  const int64_t tile = few ? n1 - n0 : kTileRows, step = few ? M : vnni_ ? 2 : kGemvRows;
  for (int64_t t0 = n0; t0 < n1; t0 += tile)
    for (int64_t m0 = 0; m0 < M; m0 += step)
      products(m0, std::min(step, M - m0), w, scales, biases, st, symmetric, y + m0 * N, N, t0, std::min(n1, t0 + tile));
}

void QuantRows::products(int64_t m0, int64_t count, const uint32_t* w, const void* scales, const void* biases,
                         ScaleType st, bool symmetric, float* y, int64_t N, int64_t n0, int64_t n1) const {
#ifdef MLXTOY_AVX2
  const int64_t K = K_, groups = K / 32;
  if (vnni_) {
    const int64_t blocks = vnni_blocks(K), lanes = vnni_lanes(bits_), b = bits_;
    const VnniX x{bytes_.data() + m0 * blocks * 256, xsl_.data() + m0 * blocks * lanes,
                  corr_.data() + m0 * blocks * lanes, sums_.data() + m0 * groups};
    if (st == ScaleType::F16) qgemv_vnni<ScaleType::F16>(b, symmetric, count, x, w, scales, biases, y, N, K, n0, n1);
    else if (st == ScaleType::BF16) qgemv_vnni<ScaleType::BF16>(b, symmetric, count, x, w, scales, biases, y, N, K, n0, n1);
    else qgemv_vnni<ScaleType::F32>(b, symmetric, count, x, w, scales, biases, y, N, K, n0, n1);
    return;
  }
  const int16_t* xr = x16_.data() + m0 * K;
  const float *steps = steps_.data() + m0 * groups, *sums = sums_.data() + m0 * groups;
  if (symmetric) qgemv4_x16<true>(st, count, xr, steps, sums, w, scales, biases, y, N, K, n0, n1);
  else qgemv4_x16<false>(st, count, xr, steps, sums, w, scales, biases, y, N, K, n0, n1);
#endif
}

// y (M, N) = x (M, K) W^T, W's rows split over the kernels' threads first come, first served;
// M <= kGemvRows, or at inference M <= gemv_max_rows (a prompt's or a batch's rows)
void qgemv(const float* x, int64_t M, const uint32_t* w, const void* scales, const void* biases, ScaleType st,
           bool symmetric, float* y, int64_t N, int64_t K, int64_t group, int bits, Pool& threads) {
  if (integer_form(K, group, bits)) {
    QuantRows rows;
    rows.reserve(M, K, bits);
    // x's rows prepared on the threads when there are many (a prompt)
    threads.run(M, std::max<int64_t>(1, 4096 / K), [&](int64_t m0, int64_t m1) { rows.prepare(x, m0, m1); });
    threads.run_dynamic(N, std::max<int64_t>(32, gemv_chunk(N, threads.threads()) / 4), [&](int64_t n0, int64_t n1) {
      rows.span(M, w, scales, biases, st, symmetric, y, N, n0, n1);
    });
    return;
  }
  const int64_t groups = K / group, elem = scale_bytes(st);
  std::vector<float> xo(M * K), xs(M * groups);
  order_x(x, xo.data(), M, K, bits);
  group_sums(x, M, K, group, xs.data());
  // a block of rows' scales and biases are widened to float32 into the thread's own buffers
  // first (kept small: read again from L1/L2 by the block's rows)
  constexpr int64_t kBlockRows = 32;
  const int64_t chunk = std::max<int64_t>(kBlockRows, gemv_chunk(N, threads.threads()) / 4);
  threads.run_dynamic(N, chunk, [&](int64_t c0, int64_t c1) {
    thread_local std::vector<float> sc, bi;
    const size_t need = static_cast<size_t>(kBlockRows * groups);
    if (sc.size() < need) sc.resize(need), bi.resize(need);
    for (int64_t n0 = c0; n0 < c1; n0 += kBlockRows) {
      const int64_t n1 = std::min(c1, n0 + kBlockRows);
      scales_to_f32(static_cast<const char*>(scales) + n0 * groups * elem, st, sc.data(), (n1 - n0) * groups);
      scales_to_f32(static_cast<const char*>(biases) + n0 * groups * elem, st, bi.data(), (n1 - n0) * groups);
      if (bits == 4) qgemv_span<4>(M, xo.data(), xs.data(), w, sc.data(), bi.data(), y, N, K, group, n0, n1);
      else qgemv_span<8>(M, xo.data(), xs.data(), w, sc.data(), bi.data(), y, N, K, group, n0, n1);
    }
  });
}

}  // namespace mlxtoy
