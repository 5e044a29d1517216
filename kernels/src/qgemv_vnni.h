// The 4- and 8-bit GEMV's integer form for CPUs with AVX-512 VNNI (Zen 4, Ice Lake and later),
// included by qgemv.cpp alone: x rounded to 16 bits per group and laid out in byte vectors once a
// call (`vnni_x`), then any range of W's rows against up to 4 rows of x a pass (`qgemv_vnni`).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "loops.h"
#include "qgemv.h"
#include "qgemv_x16.h"  // kX16

#ifdef MLXTOY_AVX2
namespace mlxtoy {

// 4 bits, groups of 32, with AVX-512 VNNI: unsigned-by-signed byte products, four to a 32-bit
// lane (vpdpbusd), the nibbles as they are read. x is rounded to 16 bits per group of 32
// (x ~ xscale_g * x16, xscale_g = max |x_g| / 32639: each input within 1 / 65278 of its group's
// largest) and x16 split into two signed bytes, x16 = 256 xh + xl, so a group's q . x16 is
// 256 (q . xh) + (q . xl), exact in int32 (|q . x16| <= 32 * 15 * 32639 < 2^24: its float is exact
// too), and
//   y = sum_g scale_g xscale_g (q . x16)_g + bias_g sum(x_g)   (sum(x_g) from x itself).
// A block of 4 groups (64 bytes of a row) gives two vectors, the low nibbles (x's even elements)
// and the high ones (the odd), and four byte products; lane l holds bytes 4l..4l+3, all of group
// l / 4, so one multiply-add scales 4 groups. Where the biases are -8 scales (a Q4_0 block:
// `symmetric`) they are not read: -8 sum(x16_g) goes into the integer sum, and a weight costs 4.5
// bits of memory where it costs 5 with biases (float16).
// 8 bits, groups of 32 (a Q8_0 block's, an 8-bit output layer's): the same split, the bytes in
// their own order, so a block is two vectors of 64 weights, each with x16's high and low bytes
// (lane l: weights 4l..4l+3 of its half, group l / 8 of it); a lane's q . x16 (4 weights, within
// 4 * 255 * 32639 < 2^25) is exact in int32 and rounded once (2^-24 of it) as a float, summed
// with its group's other 7 in the row's float accumulator, where the float form widened every
// weight to float32 (a conversion and an FMA per 16 weights and row of x; here a byte product per
// 64). Symmetric (Q8_0's biases, -128 scales): -128 sum(x16_g) on the group's first lane.
constexpr int64_t kVnniAheadPasses = 2;
// the helpers' lambdas: a lambda takes neither the target nor the inlining of the function it is in
#define VNNI_INLINE __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
// x's scales (and corrections) a block: a lane per 4 weights of a group's vector (16 at 4 bits,
// where a vector holds the block's 4 groups; 32 at 8 bits, two vectors)
constexpr int64_t vnni_lanes(int bits) { return bits == 8 ? 32 : 16; }

// 4 (or 16) scales or biases of type T from p as float32 (T: float, or uint16_t holding float16
// (F16 true) or bfloat16 bits)
template <ScaleType T>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline __m128 load4(const void* p, int64_t i) {
  if constexpr (T == ScaleType::F32) return _mm_loadu_ps(static_cast<const float*>(p) + i);
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  if constexpr (T == ScaleType::F16) return _mm_cvtph_ps(h);
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

template <ScaleType T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const void* p, int64_t i, __mmask16 k) {
  if constexpr (T == ScaleType::F32) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(p) + i);
  if constexpr (T == ScaleType::F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x as vnni_x lays it out: per row of x and block, the 4 byte vectors (4 bits: high bytes of the
// even elements, low bytes of the even, then the odd; 8 bits: high bytes of elements 0..63, their
// low bytes, then 64..127's), xscale on its group's lanes, and (symmetric) -2^(bits - 1) sum(x16_g)
// on the group's first lane (the low bytes' sums start from it)
struct VnniX {
  const int8_t* bytes;  // (M, blocks, 4, 64), blocks = vnni_blocks(K); a partial block's missing groups 0
  const float* xsl;     // (M, blocks * vnni_lanes(bits))
  const int32_t* corr;  // (M, blocks * vnni_lanes(bits))
  const float* sums;    // (M, K / 32): sum(x_g)
};

// the 4 scales of block blk of a row whose last block holds only `groups` (< 4) groups: those, then
// zeros (a masked load: the row's end is not read past; a zero scale times the missing groups'
// zero products). A copy through memory here was a call: every vector register of the pass
// spilled around it, a third of the 4-bit GEMV's time on SmolLM2's 576-wide rows (4.5 blocks)
template <ScaleType T>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline __m128 load4_tail(const void* p, int64_t blk,
                                                                                   int64_t groups) {
  const __mmask8 k = static_cast<__mmask8>((1u << groups) - 1);
  const char* at = static_cast<const char*>(p) + 4 * blk * scale_bytes(T);
  if constexpr (T == ScaleType::F32) return _mm_maskz_loadu_ps(k, at);
  const __m128i h = _mm_maskz_loadu_epi16(k, at);
  if constexpr (T == ScaleType::F16) return _mm_cvtph_ps(h);
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

// A lane's q . x16 from the byte products with x16's high bytes (hi_*) and low bytes (lo_*): two
// independent sums (the low one starting from the correction, negated: one op less than its
// subtraction), the high one shifted up 8 bits. (Summing the low products onto the shifted high
// sum saves an op, but its one chain took 2-4% longer at 1 and 2 rows of x.)
template <bool Sym>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline __m512i vnni_sum2(
    __m512i w0, __m512i w1, __m512i hi0, __m512i hi1, __m512i lo0, __m512i lo1, __m512i corr) {
  const __m512i dh = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, hi0), w1, hi1);
  const __m512i dl = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(Sym ? corr : _mm512_setzero_si512(), w0, lo0), w1, lo1);
  return _mm512_add_epi32(_mm512_slli_epi32(dh, 8), dl);
}

template <bool Sym>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline __m512i vnni_sum1(
    __m512i w, __m512i hi, __m512i lo, __m512i corr) {
  const __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, hi);
  const __m512i dl = _mm512_dpbusd_epi32(Sym ? corr : _mm512_setzero_si512(), w, lo);
  return _mm512_add_epi32(_mm512_slli_epi32(dh, 8), dl);
}

// acc + (d's float) xscale wscale, in this order (the bits every form of the product gives)
__attribute__((target("avx512f"), always_inline)) inline __m512 vnni_scaled(__m512i d, __m512 xsl, __m512 sv,
                                                                           __m512 acc) {
  return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), xsl), sv, acc);
}

// vnni_block for 8-bit rows: the block's two vectors of 64 weights (groups 0-1, 2-3), each against
// x16's high and low bytes of its half. Up to 2 rows of x (R = 8 or 4 rows of W): their vectors
// held while the rows of W stream past; more (R = 2): the rows of W held while the rows of x
// stream past. Each held set then fits the registers beside the accumulators; x held for 4 rows
// spilled, and 3-4 rows of x now take 12-35% less time (bench/kernel_ab.py, a Zen 4)
template <int M, int R, ScaleType T, bool Sym, bool Tail>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"), always_inline)) inline void vnni_block8(
    const VnniX& x, const uint8_t* q, const char* s, int64_t K, int64_t blk, int64_t tail_groups, __m512 (&acc)[R][M]) {
  constexpr int64_t elem = scale_bytes(T), lanes = vnni_lanes(8);
  const int64_t groups = K / 32, row_bytes = K, ahead = kVnniAheadPasses * R, blocks = vnni_blocks(K);
  // a vector's lanes 0-7 hold its first group, 8-15 its second
  const __m512i spread[2] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                             _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2)};
  const int halves = Tail && tail_groups <= 2 ? 1 : 2;  // a tail of 1-2 groups has no second vector
  // row r of W's block: its two vectors and their scales, a lane each
  auto w_row = [&](int r, __m512i (&v)[2], __m512 (&sv)[2]) VNNI_INLINE {
    const uint8_t* qb = q + r * row_bytes + blk * 128;
    _mm_prefetch(reinterpret_cast<const char*>(qb + ahead * row_bytes), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(qb + ahead * row_bytes + 64), _MM_HINT_T1);
    __m128 s4;
    if constexpr (Tail) {
      const int64_t first = std::min<int64_t>(tail_groups, 2);
      v[0] = _mm512_maskz_loadu_epi8(first == 2 ? ~__mmask64{0} : (__mmask64{1} << (32 * first)) - 1, qb);
      v[1] = tail_groups > 2 ? _mm512_maskz_loadu_epi8((__mmask64{1} << (32 * (tail_groups - 2))) - 1, qb + 64)
                             : _mm512_setzero_si512();
      s4 = load4_tail<T>(s + r * groups * elem, blk, tail_groups);
    } else {
      v[0] = _mm512_loadu_si512(qb), v[1] = _mm512_loadu_si512(qb + 64);
      s4 = load4<T>(s + r * groups * elem, 4 * blk);
    }
    for (int h = 0; h < 2; ++h) sv[h] = _mm512_permutexvar_ps(spread[h], _mm512_castps128_ps512(s4));
  };
  // row m of x's block: per half, x16's high and low bytes, the scales and the corrections
  struct XRow {
    __m512i hi[2], lo[2], corr[2];
    __m512 xsl[2];
  };
  auto x_row = [&](int m) VNNI_INLINE {
    XRow xr;
    const int8_t* xb = x.bytes + (m * blocks + blk) * 256;
    for (int h = 0; h < 2; ++h) {
      xr.hi[h] = _mm512_loadu_si512(xb + 128 * h), xr.lo[h] = _mm512_loadu_si512(xb + 128 * h + 64);
      xr.xsl[h] = _mm512_loadu_ps(x.xsl + (m * blocks + blk) * lanes + 16 * h);
      xr.corr[h] = Sym ? _mm512_loadu_si512(x.corr + (m * blocks + blk) * lanes + 16 * h) : _mm512_setzero_si512();
    }
    return xr;
  };
  // half h of row m of x's block times half h of a row of W's, into a (a lane's sum over the
  // halves of a block then runs h by h in both arrangements)
  auto product = [&](const XRow& xr, int h, __m512i v, __m512 sv, __m512& a) VNNI_INLINE {
    a = vnni_scaled(vnni_sum1<Sym>(v, xr.hi[h], xr.lo[h], xr.corr[h]), xr.xsl[h], sv, a);
  };
  if constexpr (M <= 2) {
    // (x's vectors as plain arrays: held in an array of XRow, whose members are arrays, 1-row
    // products took longer, the compiler keeping the structs on the stack)
    __m512i xh[M][2], xl[M][2], xc[M][2];
    __m512 xs[M][2];
    for (int m = 0; m < M; ++m) {
      const XRow xr = x_row(m);
      for (int h = 0; h < 2; ++h) xh[m][h] = xr.hi[h], xl[m][h] = xr.lo[h], xc[m][h] = xr.corr[h], xs[m][h] = xr.xsl[h];
    }
    for (int r = 0; r < R; ++r) {
      __m512i v[2];
      __m512 sv[2];
      w_row(r, v, sv);
      for (int h = 0; h < halves; ++h)
        for (int m = 0; m < M; ++m)
          acc[r][m] = vnni_scaled(vnni_sum1<Sym>(v[h], xh[m][h], xl[m][h], xc[m][h]), xs[m][h], sv[h], acc[r][m]);
    }
  } else {
    __m512i v[R][2];
    __m512 sv[R][2];
    for (int r = 0; r < R; ++r) w_row(r, v[r], sv[r]);
    for (int m = 0; m < M; ++m) {
      const XRow xr = x_row(m);
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < halves; ++h) product(xr, h, v[r][h], sv[r][h], acc[r][m]);
    }
  }
}

// vnni_block for 4-bit rows: the block's 64 bytes, low nibbles (even elements) and high (odd);
// which set is held as vnni_block8's
template <int M, int R, ScaleType T, bool Sym, bool Tail>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"), always_inline)) inline void vnni_block4(
    const VnniX& x, const uint8_t* q, const char* s, int64_t K, int64_t blk, int64_t tail_groups, __m512 (&acc)[R][M]) {
  constexpr int64_t elem = scale_bytes(T);
  const int64_t groups = K / 32, row_bytes = K / 2, ahead = kVnniAheadPasses * R, blocks = vnni_blocks(K);
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  // row r of W's block: its nibbles, and its 4 scales a lane each
  auto w_row = [&](int r, __m512i& lo, __m512i& hi, __m512& sv) VNNI_INLINE {
    const uint8_t* qb = q + r * row_bytes + blk * 64;
    _mm_prefetch(reinterpret_cast<const char*>(qb + ahead * row_bytes), _MM_HINT_T1);
    __m512i v;
    __m128 s4;
    if constexpr (Tail) {
      v = _mm512_maskz_loadu_epi8((__mmask64{1} << (16 * tail_groups)) - 1, qb);
      s4 = load4_tail<T>(s + r * groups * elem, blk, tail_groups);
    } else {
      v = _mm512_loadu_si512(qb);
      s4 = load4<T>(s + r * groups * elem, 4 * blk);
    }
    lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    sv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
  };
  // row m of x's block: x16's high and low bytes of the even elements and of the odd, the scales
  // and the corrections
  struct XRow {
    __m512i hi_even, lo_even, hi_odd, lo_odd, corr;
    __m512 xsl;
  };
  auto x_row = [&](int m) VNNI_INLINE {
    const int8_t* xb = x.bytes + (m * blocks + blk) * 256;
    return XRow{_mm512_loadu_si512(xb), _mm512_loadu_si512(xb + 64), _mm512_loadu_si512(xb + 128),
                _mm512_loadu_si512(xb + 192),
                Sym ? _mm512_loadu_si512(x.corr + (m * blocks + blk) * 16) : _mm512_setzero_si512(),
                _mm512_loadu_ps(x.xsl + (m * blocks + blk) * 16)};
  };
  auto product = [&](const XRow& xr, __m512i lo, __m512i hi, __m512 sv, __m512& a) VNNI_INLINE {
    a = vnni_scaled(vnni_sum2<Sym>(lo, hi, xr.hi_even, xr.hi_odd, xr.lo_even, xr.lo_odd, xr.corr), xr.xsl, sv, a);
  };
  if constexpr (M <= 2) {
    XRow xr[M];
    for (int m = 0; m < M; ++m) xr[m] = x_row(m);
    for (int r = 0; r < R; ++r) {
      __m512i lo, hi;
      __m512 sv;
      w_row(r, lo, hi, sv);
      for (int m = 0; m < M; ++m) product(xr[m], lo, hi, sv, acc[r][m]);
    }
  } else {
    __m512i lo[R], hi[R];
    __m512 sv[R];
    for (int r = 0; r < R; ++r) w_row(r, lo[r], hi[r], sv[r]);
    for (int m = 0; m < M; ++m) {
      const XRow xr = x_row(m);
      for (int r = 0; r < R; ++r) product(xr, lo[r], hi[r], sv[r], acc[r][m]);
    }
  }
}

// Block blk of the pass's R rows (B bits) against its M rows of x, into acc; Tail: the row's
// partial last block (its `tail_groups` groups' bytes, the rest of the vectors zeros), a form of
// its own so that whole blocks' loop holds no test
template <int B, int M, int R, ScaleType T, bool Sym, bool Tail>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"), always_inline)) inline void vnni_block(
    const VnniX& x, const uint8_t* q, const char* s, int64_t K, int64_t blk, int64_t tail_groups, __m512 (&acc)[R][M]) {
  if constexpr (B == 8) vnni_block8<M, R, T, Sym, Tail>(x, q, s, K, blk, tail_groups, acc);
  else vnni_block4<M, R, T, Sym, Tail>(x, q, s, K, blk, tail_groups, acc);
}

// scales (and biases, unless symmetric) read in their own type T (no widened copy: prefetched
// with the words)
template <int B, int M, int R, ScaleType T, bool Sym>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) inline void qgemv_pass_vnni(
    const VnniX& x, const uint8_t* q, const char* s, const char* b, float* y, int64_t N, int64_t K) {
  constexpr int64_t elem = scale_bytes(T);
  // prefetched into L2 (into L1 they evicted the pass's own lines), two passes ahead
  const int64_t groups = K / 32, ahead = kVnniAheadPasses * R;
  for (int r = 0; r < R; ++r)  // the rows' scales and biases
    for (int64_t o = 0; o < groups * elem; o += 64) {
      _mm_prefetch(s + (r + ahead) * groups * elem + o, _MM_HINT_T1);
      if constexpr (!Sym) _mm_prefetch(b + (r + ahead) * groups * elem + o, _MM_HINT_T1);
    }
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t full = K / kVnniBlock, tail_groups = (K % kVnniBlock) / 32;
  for (int64_t blk = 0; blk < full; ++blk) vnni_block<B, M, R, T, Sym, false>(x, q, s, K, blk, 0, acc);
  if (tail_groups) vnni_block<B, M, R, T, Sym, true>(x, q, s, K, full, tail_groups, acc);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float total = _mm512_reduce_add_ps(acc[r][m]);
      if constexpr (!Sym) {
        __m512 bacc = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g += 16) {
          const __mmask16 k = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
          bacc = _mm512_fmadd_ps(load16<T>(b + r * groups * elem, g, k),
                                 _mm512_maskz_loadu_ps(k, x.sums + m * groups + g), bacc);
        }
        total += _mm512_reduce_add_ps(bacc);
      }
      y[m * N + r] = total;
    }
}

template <int B, int M, ScaleType T, bool Sym>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) void qgemv_rows_vnni(
    const VnniX& x, const uint32_t* w, const void* scales, const void* biases, float* y, int64_t N, int64_t K,
    int64_t n0, int64_t n1) {
  constexpr int R = M == 1 ? 8 : M == 2 ? 4 : 2;
  constexpr int64_t elem = scale_bytes(T);
  const int64_t words = K * B / 32, row_sc = K / 32 * elem;
  auto sc = static_cast<const char*>(scales), bi = static_cast<const char*>(biases);
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    qgemv_pass_vnni<B, M, R, T, Sym>(x, reinterpret_cast<const uint8_t*>(w + n * words), sc + n * row_sc,
                                     bi + n * row_sc, y + n, N, K);
  for (; n < n1; ++n)
    qgemv_pass_vnni<B, M, 1, T, Sym>(x, reinterpret_cast<const uint8_t*>(w + n * words), sc + n * row_sc,
                                     bi + n * row_sc, y + n, N, K);
}

template <int B, ScaleType T, bool Sym>
void qgemv_vnni(int64_t M, const VnniX& x, const uint32_t* w, const void* scales, const void* biases, float* y,
                int64_t N, int64_t K, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return qgemv_rows_vnni<B, 1, T, Sym>(x, w, scales, biases, y, N, K, n0, n1);
    case 2: return qgemv_rows_vnni<B, 2, T, Sym>(x, w, scales, biases, y, N, K, n0, n1);
    case 3: return qgemv_rows_vnni<B, 3, T, Sym>(x, w, scales, biases, y, N, K, n0, n1);
    default: return qgemv_rows_vnni<B, 4, T, Sym>(x, w, scales, biases, y, N, K, n0, n1);
  }
}

// rows [n0, n1) of y (M, N) = x W^T for M (at most 4) rows of x prepared by vnni_x, W `bits` wide
template <ScaleType T>
void qgemv_vnni(int bits, bool symmetric, int64_t M, const VnniX& x, const uint32_t* w, const void* scales,
                const void* biases, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (bits == 8) {
    if (symmetric) return qgemv_vnni<8, T, true>(M, x, w, scales, biases, y, N, K, n0, n1);
    return qgemv_vnni<8, T, false>(M, x, w, scales, biases, y, N, K, n0, n1);
  }
  if (symmetric) return qgemv_vnni<4, T, true>(M, x, w, scales, biases, y, N, K, n0, n1);
  qgemv_vnni<4, T, false>(M, x, w, scales, biases, y, N, K, n0, n1);
}


// 16 int32 lanes (each within a signed byte) as 16 bytes at `to`
__attribute__((target("avx512f"))) inline void store16(int8_t* to, __m512i v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(to), _mm512_cvtepi32_epi8(v));
}

// x (M, K) for qgemv_vnni (VnniX) against a W `bits` wide: rounded to 16 bits per group of 32 and
// split in bytes, and each group's sum (sums (M, K / 32)). Vectors: per call this runs on one
// thread before the rows are shared out, where a scalar loop took as long as a small matrix's
// whole product.
__attribute__((target("avx512f,avx512bw"))) inline void vnni_x(const float* x, int64_t M, int64_t K, int bits,
                                                              int8_t* bytes, float* xsl, int32_t* corr, float* sums) {
  const int64_t blocks = vnni_blocks(K), lanes = vnni_lanes(bits);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512 lim = _mm512_set1_ps(kX16), nlim = _mm512_set1_ps(-kX16);
  const __m512i b128 = _mm512_set1_epi32(128), b255 = _mm512_set1_epi32(255);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      int8_t* out = bytes + (m * blocks + blk) * 256;
      const float* xb = x + m * K + blk * kVnniBlock;
      for (int j = 0; j < 4; ++j) {
        // group j's lanes: 4 bits, 4 of the block's 16; 8 bits, 8 of its vector's 16 (j / 2)
        const int64_t at = bits == 8 ? 16 * (j / 2) + 8 * (j % 2) : 4 * j, width = bits == 8 ? 8 : 4;
        float* sl = xsl + (m * blocks + blk) * lanes + at;
        int32_t* cr = corr + (m * blocks + blk) * lanes + at;
        // 8 bits: element 32 j + k sits in byte 32 (j % 2) + k of half j / 2's high and low vectors
        int8_t* half = out + 128 * (j / 2) + 32 * (j % 2);
        if (blk * kVnniBlock + 32 * j >= K) {  // a group past the row's end (a partial block): zeros
          if (bits == 8) std::memset(half, 0, 32), std::memset(half + 64, 0, 32);
          else
            for (int i = 0; i < 4; ++i) std::memset(out + 64 * i + 16 * j, 0, 16);
          std::fill(sl, sl + width, 0.0f), std::fill(cr, cr + width, 0);
          continue;
        }
        const __m512 v0 = _mm512_loadu_ps(xb + 32 * j), v1 = _mm512_loadu_ps(xb + 32 * j + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float scale = amax > 0.0f ? amax / kX16 : 1.0f, inv = 1.0f / scale;
        const __m512 vi = _mm512_set1_ps(inv);
        // x16 = round(x / scale) within +-kX16; x16 = 256 xh + xl, xl and xh signed bytes
        __m512i r[2], hi[2], lo[2];
        r[0] = _mm512_cvtps_epi32(_mm512_min_ps(lim, _mm512_max_ps(nlim, _mm512_mul_ps(v0, vi))));
        r[1] = _mm512_cvtps_epi32(_mm512_min_ps(lim, _mm512_max_ps(nlim, _mm512_mul_ps(v1, vi))));
        for (int h = 0; h < 2; ++h) {
          lo[h] = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r[h], b128), b255), b128);
          hi[h] = _mm512_srai_epi32(_mm512_sub_epi32(r[h], lo[h]), 8);
        }
        if (bits == 8) {
          store16(half, hi[0]), store16(half + 16, hi[1]), store16(half + 64, lo[0]), store16(half + 80, lo[1]);
        } else {  // element 32 j + k sits in byte 16 j + k / 2 of the block's even (k even) or odd vectors
          store16(out + 16 * j, _mm512_permutex2var_epi32(hi[0], even, hi[1]));
          store16(out + 64 + 16 * j, _mm512_permutex2var_epi32(lo[0], even, lo[1]));
          store16(out + 128 + 16 * j, _mm512_permutex2var_epi32(hi[0], odd, hi[1]));
          store16(out + 192 + 16 * j, _mm512_permutex2var_epi32(lo[0], odd, lo[1]));
        }
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(r[0], r[1]));
        sums[m * (K / 32) + blk * 4 + j] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        for (int l = 0; l < width; ++l) sl[l] = scale, cr[l] = l == 0 ? -(1 << (bits - 1)) * sum : 0;
      }
    }
}

#undef VNNI_INLINE

}  // namespace mlxtoy
#endif
