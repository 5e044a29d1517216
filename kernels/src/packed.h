// mlxtoy kernels: weights kept packed for decoding where that is lossless (4-, 5- and 8-bit
// blocks of 32), their packers and GEMVs, and the Matrix a decode reads through in any of its
// forms: those, float32, or MLX's affine 4-bit layout (included by kernels.cpp and decode.cpp).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "gemv.h"   // gemv_span and its chains' sums for the float32 form; MLXTOY_AVX2 for the SIMD forms
#include "qgemv.h"  // QuantRows for the affine form

namespace mlxtoy {

// The rows of a packed W that one row of x takes a pass (gemv_packed_span_simd), by Pack code:
// 0 the built-in choice, else 1, 2, 4 or 8 as measured on this machine (set_packed_row_pass).
// One for the whole process (an inline variable: kernels.cpp's and decode.cpp's); any value
// gives the same bits, so a change between two calls never changes a result.
inline std::atomic<int> packed_row_pass_set[8];

namespace {

// ---- lossless 4-, 5- and 8-bit weights -----------------------------------------------------
// A row of weights that are all of the form d * q + m (q in 0..15) per block of 32, as a Q4_1
// GGUF dequantizes to, kept as (d, m, 16 bytes of nibbles: element j in the low nibble of byte
// j, element j + 16 in the high one): decoding reads 0.75 bytes a weight instead of 4.
struct Q4Block {
  float d, m;
  uint8_t qs[16];
};
static_assert(sizeof(Q4Block) == 24, "Q4Block is 24 bytes");
constexpr int64_t kQ4 = 32;  // weights per block (both kinds)

// A row of MLX's affine quantized layout (mx.quantize: per group of `group` inputs
// w = scale * q + bias, q packed low bits first, 32 / B of them to a uint32 word) to float32,
// as mx.dequantize forms it: scale * q + bias, one rounding each.
template <int B>
inline void dequant_affine_row(const uint32_t* w, const float* scales, const float* biases, float* y, int64_t d_in,
                               int64_t group) {
  constexpr int per_word = 32 / B;
  constexpr uint32_t mask = (1u << B) - 1;
  for (int64_t g = 0; g < d_in / group; ++g) {
    const float s = scales[g], b = biases[g];
    const uint32_t* wg = w + g * (group / per_word);
    float* yg = y + g * group;
    for (int64_t j = 0; j < group / per_word; ++j) {
      const uint32_t v = wg[j];
      for (int t = 0; t < per_word; ++t) yg[j * per_word + t] = s * static_cast<float>((v >> (B * t)) & mask) + b;
    }
  }
}

// A row of weights that are all d * q (q in -127..127) per half-block of 16, as a Q8_0 or Q5_0
// GGUF dequantizes to (one d for both halves) and a Q6_K one (a scale per 16): (d of weights
// 0..15, d of 16..31, 32 signed bytes), 1.25 bytes a weight.
struct Q8Block {
  float d[2];
  int8_t qs[32];
};
static_assert(sizeof(Q8Block) == 40, "Q8Block is 40 bytes");

// 5 bits: d * q + m, q in 0..31 (Q5_1's and Q5_K's groups), the low 4 bits as a Q4Block's and
// the fifth bit of weight j in bit j of qh
struct Q5Block {
  float d, m;
  uint8_t qs[16];
  uint32_t qh;
};
static_assert(sizeof(Q5Block) == 28, "Q5Block is 28 bytes");

// Q4_0's and Q8_0's blocks as the GGUF holds them: a float16 d, then 16 bytes of nibbles as a
// Q4Block's, w = d * (q - 8) (0.5625 bytes a weight), or 32 signed bytes, w = d * q (1.0625).
// Every such weight is exact in float32 (11 bits of d times at most 8 of q), so a block unpacks
// to the weights it was packed from with one rounding-free multiply.
struct Q40Block {
  uint16_t d;
  uint8_t qs[16];
};
static_assert(sizeof(Q40Block) == 18, "Q40Block is 18 bytes");

struct Q80Block {
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(Q80Block) == 34, "Q80Block is 34 bytes");

// The packed forms (their codes are decode.cpp's form bits, where 3 is MLX's affine 4-bit layout)
enum class Pack : int { none = 0, q4 = 1, q8 = 2, q5 = 4, q4_0 = 5, q8_0 = 6 };
struct PackName {
  Pack pack;
  const char* name;  // pack(w, form)'s
};
constexpr PackName kPacks[] = {{Pack::q4, "q4"}, {Pack::q8, "q8"}, {Pack::q5, "q5"}, {Pack::q4_0, "q4_0"}, {Pack::q8_0, "q8_0"}};

// the form pack(w, form) names (none: no form's)
inline Pack pack_named(const std::string& form) {
  for (const PackName& named : kPacks)
    if (form == named.name) return named.pack;
  return Pack::none;
}

// the bytes of a block of 32 weights in form p
constexpr int64_t pack_block_bytes(Pack p) {
  switch (p) {
    case Pack::q4: return sizeof(Q4Block);
    case Pack::q8: return sizeof(Q8Block);
    case Pack::q5: return sizeof(Q5Block);
    case Pack::q4_0: return sizeof(Q40Block);
    case Pack::q8_0: return sizeof(Q80Block);
    default: return 0;
  }
}

// f(Pack-templated) called with p as a template argument (p not none)
template <class F>
inline void with_pack(Pack p, F&& f) {
  switch (p) {
    case Pack::q4: return f.template operator()<Pack::q4>();
    case Pack::q8: return f.template operator()<Pack::q8>();
    case Pack::q5: return f.template operator()<Pack::q5>();
    case Pack::q4_0: return f.template operator()<Pack::q4_0>();
    case Pack::q8_0: return f.template operator()<Pack::q8_0>();
    default: return;
  }
}

// A block of 32 weights on a grid: every weight exactly fl(fl(d * q) + base) for integer q in
// [qmin, qmax] (gguf-py's dequantization in float32, one rounding per op). 4-bit: base = min,
// q in 0..15, d = (max - min) / k for the block's highest q, k, tried from 15 (Q4_1, whose
// quantizer spans the block) down (Q4_0, d * (q - 8): its largest magnitude at q = 0 or 15 and
// the other end anywhere; Q4_K's groups, d * q - m where q = 0 is used). 5-bit: the same with q
// in 0..31, k from 31 down (Q5_1; Q5_K's groups). 8-bit: base = 0, q in
// -127..127, one d for the block, absmax / 127 (Q8_0, whose fl(d * q) adding +0 leaves as it
// compares) or absmax / 16 (Q5_0, d * (q - 16)); else a d for each half of 16, its absmax / k
// for k from 32 down (Q6_K: d * scale * q, q in -32..31, a scale per 16). The quantizer's d was
// rounded to float16, so the float32 quotient's neighbours are tried too. The float16 forms
// (Q4_0's and Q8_0's blocks) take base 0, one d for the block that is a float16 value, and q in
// -8..7 (d = -+absmax / k for k from 8 down: the reference quantizer's extreme is q - 8 = -8, of
// either sign) or -127..127 (absmax / 127 or / 16, as the 8-bit form's first tries).
struct Grid {
  float d, base;
  int32_t q[32];
  float d_half[2];  // 8-bit: the d of each half (both the block's d where one fits)
};

// the divisors of an 8-bit block's absmax tried for d, in order (4- and 5-bit: the span's, the
// highest q down to 1)
constexpr float kGridSteps8[] = {127, 16};
constexpr int kHalfSteps8 = 32;  // a half's divisors: 32, 31, ..., 1

#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
inline bool grid_fits_portable(const float* x, float d0, float qmin, float qmax, Grid& g, int first, int n) {
  for (float d : {d0, std::nextafter(d0, 0.0f), std::nextafter(d0, 1e30f)}) {
    bool ok = true;
    for (int j = first; j < first + n && ok; ++j) {
      float q = d != 0.0f ? std::nearbyint((x[j] - g.base) / d) : 0.0f;
      q = std::min(std::max(q, qmin), qmax);
      float back = d * q;
      back = back + g.base;
      ok = back == x[j];
      g.q[j] = static_cast<int32_t>(q);
    }
    if (ok) {
      g.d = d;
      return true;
    }
  }
  return false;
}

// The grids of the comment above, tried in its order, from a block's min and max (4- and 5-bit)
// or each half's absmax (8-bit): fits(d0, qmin, qmax, first, n) checks weights [first, first + n)
// on d0's grid or a neighbour's (setting g.d and g.q there), one form's check (portable or AVX2).
template <class Fits>
inline bool grid_search(Pack p, float lo, float hi, const float (&amax)[2], Grid& g, Fits&& fits) {
  uint16_t h;
  if (p == Pack::q4_0 || p == Pack::q8_0) {
    const float a = std::max(amax[0], amax[1]);
    if (!std::isfinite(a)) return false;
    g.base = 0.0f;
    if (p == Pack::q8_0) {
      for (float k : kGridSteps8)
        if (fits(a / k, -127.0f, 127.0f, 0, kQ4) && half_exact(g.d, h)) return true;
      return false;
    }
    for (int k = 8; k >= 1; --k)
      for (float sign : {-1.0f, 1.0f})
        if (fits(sign * a / static_cast<float>(k), -8.0f, 7.0f, 0, kQ4) && half_exact(g.d, h)) return true;
    return false;
  }
  const int bits = p == Pack::q4 ? 4 : p == Pack::q5 ? 5 : 8;
  if (bits == 4 || bits == 5) {
    if (!std::isfinite(lo) || !std::isfinite(hi)) return false;  // (a NaN fails the check too)
    g.base = lo;
    const int top = (1 << bits) - 1;  // the highest q, and the first divisor of the span tried
    for (int k = top; k >= 1; --k)
      if (fits((hi - lo) / static_cast<float>(k), 0.0f, static_cast<float>(top), 0, kQ4)) return true;
    return false;
  }
  if (!std::isfinite(amax[0]) || !std::isfinite(amax[1])) return false;
  g.base = 0.0f;
  for (float k : kGridSteps8)
    if (fits(std::max(amax[0], amax[1]) / k, -127.0f, 127.0f, 0, kQ4)) {
      g.d_half[0] = g.d_half[1] = g.d;
      return true;
    }
  for (int h = 0; h < 2; ++h) {
    bool ok = false;
    for (int k = kHalfSteps8; k >= 1 && !ok; --k)
      ok = fits(amax[h] / static_cast<float>(k), -127.0f, 127.0f, 16 * h, 16);
    if (!ok) return false;
    g.d_half[h] = g.d;
  }
  return true;
}

inline bool grid_block_portable(const float* x, Pack bits, Grid& g) {
  float lo = x[0], hi = x[0], amax[2] = {0.0f, 0.0f};
  for (int j = 0; j < kQ4; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
    amax[j / 16] = std::max(amax[j / 16], std::fabs(x[j]));
  }
  return grid_search(bits, lo, hi, amax, g, [&](float d0, float qmin, float qmax, int first, int n) {
    return grid_fits_portable(x, d0, qmin, qmax, g, first, n);
  });
}

#ifdef MLXTOY_AVX2
// the min and max of 8 lanes (their sum: hsum8, loops.h)
__attribute__((target("avx2"))) inline float hmin8(__m256 v) {
  __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_min_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_min_ss(s, _mm_movehdup_ps(s)));
}

__attribute__((target("avx2"))) inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// The same with AVX2, 8 weights a vector: the same divisions, roundings and checks; AVX2 alone,
// without FMA, so d * q + base stays two roundings.
__attribute__((target("avx2"))) inline bool grid_fits_avx2(const __m256 (&x)[4], float d0, float qmin, float qmax,
                                                           Grid& g, int first_weight, int weights) {
  const int first = first_weight / 8, n = weights / 8;  // in vectors
  const __m256 base = _mm256_set1_ps(g.base), low = _mm256_set1_ps(qmin), high = _mm256_set1_ps(qmax);
  for (float d : {d0, std::nextafter(d0, 0.0f), std::nextafter(d0, 1e30f)}) {
    const __m256 vd = _mm256_set1_ps(d);
    __m256i q[4];
    int same = 0xFF;
    for (int v = first; v < first + n && same == 0xFF; ++v) {  // (a wrong d: out at its first vector, mostly)
      __m256 qf = d != 0.0f ? _mm256_div_ps(_mm256_sub_ps(x[v], base), vd) : _mm256_setzero_ps();
      qf = _mm256_round_ps(qf, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      qf = _mm256_min_ps(_mm256_max_ps(qf, low), high);
      __m256 back = _mm256_add_ps(_mm256_mul_ps(vd, qf), base);
      same &= _mm256_movemask_ps(_mm256_cmp_ps(back, x[v], _CMP_EQ_OQ));
      q[v] = _mm256_cvtps_epi32(qf);
    }
    if (same == 0xFF) {
      for (int v = first; v < first + n; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(g.q + 8 * v), q[v]);
      g.d = d;
      return true;
    }
  }
  return false;
}

__attribute__((target("avx2"))) inline bool grid_block_avx2(const float* p, Pack bits, Grid& g) {
  const __m256 x[4] = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)};
  const float lo = hmin8(_mm256_min_ps(_mm256_min_ps(x[0], x[1]), _mm256_min_ps(x[2], x[3])));
  const float hi = hmax8(_mm256_max_ps(_mm256_max_ps(x[0], x[1]), _mm256_max_ps(x[2], x[3])));
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const float amax[2] = {hmax8(_mm256_max_ps(_mm256_and_ps(x[0], abs), _mm256_and_ps(x[1], abs))),
                         hmax8(_mm256_max_ps(_mm256_and_ps(x[2], abs), _mm256_and_ps(x[3], abs)))};
  return grid_search(bits, lo, hi, amax, g, [&](float d0, float qmin, float qmax, int first, int n) {
    return grid_fits_avx2(x, d0, qmin, qmax, g, first, n);
  });
}

inline bool grid_block(const float* x, Pack bits, Grid& g) {
  return cpu_avx2() ? grid_block_avx2(x, bits, g) : grid_block_portable(x, bits, g);
}
#else
inline bool grid_block(const float* x, Pack bits, Grid& g) { return grid_block_portable(x, bits, g); }
#endif

// A block from its grid: d, base and the q (4-bit: nibbles; 5-bit: nibbles and the fifth bits
// word; 8-bit: each half's d and the bytes)
inline void set_block(const Grid& g, Q4Block& out) {
  out.d = g.d, out.m = g.base;
  for (int j = 0; j < 16; ++j) out.qs[j] = static_cast<uint8_t>(g.q[j] | (g.q[j + 16] << 4));
}

inline void set_block(const Grid& g, Q5Block& out) {
  out.d = g.d, out.m = g.base, out.qh = 0;
  for (int j = 0; j < 16; ++j) out.qs[j] = static_cast<uint8_t>((g.q[j] & 15) | ((g.q[j + 16] & 15) << 4));
  for (int j = 0; j < kQ4; ++j) out.qh |= static_cast<uint32_t>(g.q[j] >> 4) << j;
}

inline void set_block(const Grid& g, Q8Block& out) {
  out.d[0] = g.d_half[0], out.d[1] = g.d_half[1];
  for (int j = 0; j < kQ4; ++j) out.qs[j] = static_cast<int8_t>(g.q[j]);
}

inline void set_block(const Grid& g, Q40Block& out) {
  half_exact(g.d, out.d);
  for (int j = 0; j < 16; ++j) out.qs[j] = static_cast<uint8_t>((g.q[j] + 8) | ((g.q[j + 16] + 8) << 4));
}

inline void set_block(const Grid& g, Q80Block& out) {
  half_exact(g.d, out.d);
  for (int j = 0; j < kQ4; ++j) out.qs[j] = static_cast<int8_t>(g.q[j]);
}

// the block type of form P
template <Pack P>
using BlockOf = std::conditional_t<P == Pack::q4, Q4Block, std::conditional_t<P == Pack::q8, Q8Block,
                std::conditional_t<P == Pack::q5, Q5Block, std::conditional_t<P == Pack::q4_0, Q40Block, Q80Block>>>>;

// Packs a row of K (a multiple of 32) weights into form P's blocks; false where any block is
// not on its grid: then the row must stay float32.
template <Pack P>
inline bool pack_row(const float* w, int64_t K, void* out) {
  auto* blocks = static_cast<BlockOf<P>*>(out);
  Grid g;
  for (int64_t b = 0; b < K / kQ4; ++b) {
    if (!grid_block(w + b * kQ4, P, g)) return false;
    set_block(g, blocks[b]);
  }
  return true;
}

// ---- the packed GEMV ----
// A packed matrix's rows against rows of x, each output summed as the float32 GEMV (gemv_span)
// sums it over the weights the blocks were packed from: a block's weights unpacked in registers,
// one rounding an op as `unpack` forms them, then the same FMA chain in the same order. So a row
// decoded from packs gets the bits of the float32 weights, and in a batch the bits it gets alone.
// Where a few rows of x share a pass the blocks are read from memory once for all of them, where
// `unpack` into a buffer and the several-rows GEMV paid for a whole matrix's unpacking every step.

// Rows of x up to which the packed GEMV reads the blocks as they are; past it they are unpacked
// once for all the rows (SmolLM2's packs, BatchDecoder, Zen 4: 2-6 rows 15-100% faster read as
// they are, 8 alike, 12 and 16 5-10% slower)
constexpr int64_t kPackedPassRows = 8;

#ifdef MLXTOY_AVX2
// v as it is: the multiply before it and the add after it stay two roundings (the build lets the
// compiler contract a * b + c into one FMA)
__attribute__((target("avx512f"), always_inline)) inline __m512 unfused(__m512 v) {
  __asm__("" : "+v"(v));
  return v;
}

__attribute__((target("avx2"), always_inline)) inline __m256 unfused(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

// block b of a packed row as float32: 16 weights a vector, two vectors (AVX-512)
template <Pack P>
__attribute__((target("avx512f,f16c"), always_inline)) inline void unpack_block_avx512(const void* row, int64_t b,
                                                                                      __m512& w0, __m512& w1) {
  if constexpr (P == Pack::q4_0) {
    // as a Q4Block's, the 16 values d (q - 8) each exact
    const Q40Block& blk = static_cast<const Q40Block*>(row)[b];
    const __m512 values = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(blk.d)),
                                        _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs)));
    w0 = _mm512_permutexvar_ps(bytes, values);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
  } else if constexpr (P == Pack::q8_0) {
    const Q80Block& blk = static_cast<const Q80Block*>(row)[b];
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(blk.d));
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs)))));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs + 16)))));
  } else if constexpr (P == Pack::q4) {
    // a block's 16 possible weights, fl(fl(d q) + m) for q = 0..15, looked up by nibble (a
    // permute reads an index's low 4 bits: a byte's low nibble as it is)
    const Q4Block& blk = static_cast<const Q4Block*>(row)[b];
    const __m512 values = _mm512_add_ps(
        unfused(_mm512_mul_ps(_mm512_set1_ps(blk.d), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))),
        _mm512_set1_ps(blk.m));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs)));
    w0 = _mm512_permutexvar_ps(bytes, values);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
  } else if constexpr (P == Pack::q5) {
    // the 32 possible weights as two tables, q = 0..15 and 16..31; a weight's fifth bit (qh's
    // bit, a mask bit) takes its value from the second
    const Q5Block& blk = static_cast<const Q5Block*>(row)[b];
    const __m512 d = _mm512_set1_ps(blk.d), m = _mm512_set1_ps(blk.m);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 low = _mm512_add_ps(unfused(_mm512_mul_ps(d, iota)), m);
    const __m512 high = _mm512_add_ps(unfused(_mm512_mul_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16)))), m);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs)));
    const __m512i nibbles = _mm512_srli_epi32(bytes, 4);
    w0 = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(bytes, low), static_cast<__mmask16>(blk.qh), bytes, high);
    w1 = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(nibbles, low), static_cast<__mmask16>(blk.qh >> 16),
                                    nibbles, high);
  } else {
    const Q8Block& blk = static_cast<const Q8Block*>(row)[b];
    w0 = _mm512_mul_ps(_mm512_set1_ps(blk.d[0]),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs)))));
    w1 = _mm512_mul_ps(_mm512_set1_ps(blk.d[1]),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs + 16)))));
  }
}

// R packed rows (`row_bytes` apart) against MR rows of x: gemv_block_avx512's chains and sums; the
// next pass's R rows prefetched meanwhile (several rows' short streams of blocks from memory were
// 2-2.5x slower a block without)
template <int R, int MR, Pack P>
__attribute__((target("avx512f,f16c"))) inline void gemv_packed_block_avx512(const float* x, const char* w, int64_t row_bytes,
                                                                        float* y, int64_t N, int64_t K) {
  __m512 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / kQ4; ++b) {
    __m512 x0[MR], x1[MR];
    for (int m = 0; m < MR; ++m) x0[m] = _mm512_loadu_ps(x + m * K + b * kQ4), x1[m] = _mm512_loadu_ps(x + m * K + b * kQ4 + 16);
    for (int r = 0; r < R; ++r) {
      __m512 w0, w1;
      if constexpr (R > 1) _mm_prefetch(w + (r + R) * row_bytes + b * pack_block_bytes(P), _MM_HINT_T0);
      unpack_block_avx512<P>(w + r * row_bytes, b, w0, w1);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_fmadd_ps(w1, x1[m], _mm512_fmadd_ps(w0, x0[m], acc[r][m]));
    }
  }
  store_sums_avx512<R, MR>(acc, y, N);
}

// block b of a packed row as float32 with AVX2: 8 weights a vector, four vectors in the row's order
// (the packed GEMV's, and `unpack`'s)
template <Pack P>
__attribute__((target("avx2,f16c"), always_inline)) inline void block_weights_avx2(const void* row, int64_t b,
                                                                                  __m256 (&w)[4]) {
  __m256i q[4];  // the block's weights as integers, 8 a vector
  if constexpr (P == Pack::q4_0) {
    const Q40Block& blk = static_cast<const Q40Block*>(row)[b];
    const __m256i low4 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs + 8 * h)));
      q[h] = _mm256_sub_epi32(_mm256_and_si256(bytes, low4), eight);
      q[2 + h] = _mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight);
    }
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(blk.d));
    for (int p = 0; p < 4; ++p) w[p] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q[p]));
  } else if constexpr (P == Pack::q8_0) {
    const Q80Block& blk = static_cast<const Q80Block*>(row)[b];
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(blk.d));
    for (int p = 0; p < 4; ++p)
      w[p] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs + 8 * p)))));
  } else if constexpr (P == Pack::q4) {
    const Q4Block& blk = static_cast<const Q4Block*>(row)[b];
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; ++h) {  // bytes 8h..8h+7: elements 8h.. in their low nibbles, 16 + 8h.. in the high
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs + 8 * h)));
      q[h] = _mm256_and_si256(bytes, low4), q[2 + h] = _mm256_srli_epi32(bytes, 4);
    }
    const __m256 d = _mm256_set1_ps(blk.d), m = _mm256_set1_ps(blk.m);
    for (int p = 0; p < 4; ++p) w[p] = _mm256_add_ps(unfused(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q[p]))), m);
  } else if constexpr (P == Pack::q5) {
    const Q5Block& blk = static_cast<const Q5Block*>(row)[b];
    const __m256i low4 = _mm256_set1_epi32(15), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i qh = _mm256_set1_epi32(static_cast<int32_t>(blk.qh));
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs + 8 * h)));
      q[h] = _mm256_and_si256(bytes, low4), q[2 + h] = _mm256_srli_epi32(bytes, 4);
    }
    for (int p = 0; p < 4; ++p) {  // vector p holds weights 8p..8p+7: their fifth bits, bits 8p.. of qh
      const __m256i fifth = _mm256_and_si256(_mm256_srlv_epi32(qh, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * p))),
                                             _mm256_set1_epi32(1));
      q[p] = _mm256_or_si256(q[p], _mm256_slli_epi32(fifth, 4));
    }
    const __m256 d = _mm256_set1_ps(blk.d), m = _mm256_set1_ps(blk.m);
    for (int p = 0; p < 4; ++p) w[p] = _mm256_add_ps(unfused(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q[p]))), m);
  } else {
    const Q8Block& blk = static_cast<const Q8Block*>(row)[b];
    for (int p = 0; p < 4; ++p) q[p] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs + 8 * p)));
    const __m256 d[2] = {_mm256_set1_ps(blk.d[0]), _mm256_set1_ps(blk.d[1])};
    for (int p = 0; p < 4; ++p) w[p] = _mm256_mul_ps(d[p / 2], _mm256_cvtepi32_ps(q[p]));
  }
}

template <int R, int MR, Pack P>
__attribute__((target("avx2,fma,f16c"))) inline void gemv_packed_block_avx2(const float* x, const char* w, int64_t row_bytes,
                                                                       float* y, int64_t N, int64_t K) {
  __m256 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kQ4; ++b)
    for (int r = 0; r < R; ++r) {
      if constexpr (R > 1) _mm_prefetch(w + (r + R) * row_bytes + b * pack_block_bytes(P), _MM_HINT_T0);
      __m256 wv[4];
      block_weights_avx2<P>(w + r * row_bytes, b, wv);
      for (int p = 0; p < 4; ++p)
        for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_fmadd_ps(wv[p], _mm256_loadu_ps(x + m * K + b * kQ4 + 8 * p), acc[r][m]);
    }
  store_sums_avx2<R, MR>(acc, y, N);
}

// rows [n0, n1) of a packed W against M rows of x: R rows of W a pass (the next R prefetched)
// against up to 4 rows of x
template <Pack P, bool Avx512, int R>
inline void gemv_packed_rows_simd(const float* x, const void* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                                  int64_t n1) {
  constexpr int MR = 4;
  const int64_t row_bytes = K / kQ4 * pack_block_bytes(P);
  const char* base = static_cast<const char*>(w);
  auto pass = [&]<int Rows, int Xs>(int64_t n, int64_t m) {
    if constexpr (Avx512) gemv_packed_block_avx512<Rows, Xs, P>(x + m * K, base + n * row_bytes, row_bytes, y + m * N + n, N, K);
    else gemv_packed_block_avx2<Rows, Xs, P>(x + m * K, base + n * row_bytes, row_bytes, y + m * N + n, N, K);
  };
  auto rows = [&]<int Rows>(int64_t n) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) pass.template operator()<Rows, MR>(n, m);
    if (M - m == 3) pass.template operator()<Rows, 3>(n, m);
    else if (M - m == 2) pass.template operator()<Rows, 2>(n, m);
    else if (M - m == 1) pass.template operator()<Rows, 1>(n, m);
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows.template operator()<R>(n);
  for (; n < n1; ++n) rows.template operator()<1>(n);
}

// The same, R as measured a block at a time on the Zen 4 (one thread): with AVX-512 one row of
// x takes an 8-bit form's W a row at a time, as gemv_span's one row does (one stream, the
// hardware prefetchers'; 4 rows a pass read SmolLM2's 8-bit output layer at ~15 G weights/s
// against ~25), and a 4- or 5-bit form's 4 rows a pass: a row's one chain of two FMAs a block
// held a 4-bit one to ~33 G weights/s in cache, ~30 from memory; 4 chains ~47 and ~35 (a 5-bit
// block's own ops bind it either way, 18-22). With AVX2 a row's
// one 8-lane chain is bound by its FMAs' latency (4 a block), so 4 rows a pass (8 for 8-bit
// blocks: 1.9 ns a block, as the product in d * (x . q) form before it took; 2.5 four rows, 3.0
// a row at a time).
// Which is faster for one row depends on the CPU (the Emerald Rapids read an 8-bit form 1.31x
// faster 4 rows a pass), so that one is measured where it is used (set_packed_row_pass).
template <Pack P, bool Avx512>
constexpr int packed_row_pass_built_in() {
  constexpr bool eight = P == Pack::q8 || P == Pack::q8_0;
  return Avx512 ? (eight ? 1 : 4) : eight ? 8 : 4;
}

template <Pack P, bool Avx512>
inline void gemv_packed_span_simd(const float* x, const void* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                                  int64_t n1) {
  constexpr int several = Avx512 || P == Pack::q8 || P == Pack::q8_0 ? 4 : 2;
  if (M > 1) return gemv_packed_rows_simd<P, Avx512, several>(x, w, y, M, N, K, n0, n1);
  const int set = packed_row_pass_set[static_cast<int>(P)].load(std::memory_order_relaxed);
  switch (set ? set : packed_row_pass_built_in<P, Avx512>()) {
    case 1: return gemv_packed_rows_simd<P, Avx512, 1>(x, w, y, M, N, K, n0, n1);
    case 2: return gemv_packed_rows_simd<P, Avx512, 2>(x, w, y, M, N, K, n0, n1);
    case 8: return gemv_packed_rows_simd<P, Avx512, 8>(x, w, y, M, N, K, n0, n1);
    default: return gemv_packed_rows_simd<P, Avx512, 4>(x, w, y, M, N, K, n0, n1);
  }
}

// The same with AVX-512: 16 weights a vector (the packed GEMV's unpack_block_avx512, the same
// values); a batch of more than kPackedPassRows rows unpacks every matrix every step, ~10% of a
// step of 32 rows in the AVX2 form
template <Pack P>
__attribute__((target("avx512f,f16c"))) inline void unpack_avx512(const void* w, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, out += kQ4) {
    __m512 w0, w1;
    unpack_block_avx512<P>(w, b, w0, w1);
    _mm512_storeu_ps(out, w0);
    _mm512_storeu_ps(out + 16, w1);
  }
}

template <Pack P>
__attribute__((target("avx2,f16c"))) inline void unpack_avx2(const void* w, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, out += kQ4) {
    __m256 wv[4];
    block_weights_avx2<P>(w, b, wv);
    for (int p = 0; p < 4; ++p) _mm256_storeu_ps(out + 8 * p, wv[p]);
  }
}
#endif

// The bytes of a packed row of K weights in form p (each form's block a distinct size, so a packed
// array's width says which); -1 where K is not a multiple of 32.
inline int64_t packed_width(int64_t K, Pack p) {
  if (K % kQ4 != 0) return -1;
  return K / kQ4 * pack_block_bytes(p);
}

// the form of a packed row of K weights `width` bytes wide (none: no form's)
inline Pack pack_of_width(int64_t K, int64_t width) {
  for (const PackName& p : kPacks)
    if (width == packed_width(K, p.pack)) return p.pack;
  return Pack::none;
}

// Packed blocks back to the float32 weights they were packed from: fl(fl(d * q) + m) (Q4, Q5)
// and fl(d * q) (Q8; Q4_0's and Q8_0's forms exact), one rounding each as the grid has them
// (Grid), so never a fused multiply-add
template <Pack P>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
inline void unpack_portable(const void* packed, int64_t blocks, float* out) {
  const auto* w = static_cast<const BlockOf<P>*>(packed);
  for (int64_t b = 0; b < blocks; ++b, out += kQ4) {
    if constexpr (P == Pack::q8)
      for (int j = 0; j < kQ4; ++j) out[j] = w[b].d[j / 16] * static_cast<float>(w[b].qs[j]);
    else if constexpr (P == Pack::q8_0)
      for (int j = 0; j < kQ4; ++j) out[j] = half_to_float(w[b].d) * static_cast<float>(w[b].qs[j]);
    else
      for (int j = 0; j < 16; ++j) {
        uint32_t lo = w[b].qs[j] & 15, hi = w[b].qs[j] >> 4;
        if constexpr (P == Pack::q4_0) {
          const float d = half_to_float(w[b].d);
          out[j] = d * (static_cast<float>(lo) - 8.0f), out[j + 16] = d * (static_cast<float>(hi) - 8.0f);
        } else {
          if constexpr (P == Pack::q5) lo |= ((w[b].qh >> j) & 1) << 4, hi |= ((w[b].qh >> (j + 16)) & 1) << 4;
          out[j] = w[b].d * static_cast<float>(lo) + w[b].m;
          out[j + 16] = w[b].d * static_cast<float>(hi) + w[b].m;
        }
      }
  }
}

template <Pack P>
inline void unpack_blocks(const void* packed, int64_t blocks, float* out) {
#ifdef MLXTOY_AVX2
  if (cpu_avx512()) return unpack_avx512<P>(packed, blocks, out);
  if (cpu_avx2()) return unpack_avx2<P>(packed, blocks, out);
#endif
  unpack_portable<P>(packed, blocks, out);
}

struct Affine {  // MLX's affine 4- or 8-bit layout, groups of 32 (qgemv.h: the integer forms read it)
  const uint32_t* w;
  const void *scales, *biases;
  ScaleType st;
  bool symmetric;  // the biases are -2^(bits - 1) scales, and not read
  int bits;
};

// A weight matrix (N, K) in float32, packed (form `pack`) or MLX's affine 4- or 8-bit layout;
// rows(n) is the matrix from row n on.
struct Matrix {
  const float* f32;
  const void* packed;
  Pack pack;
  int64_t K;
  Affine affine = {};

  Matrix rows(int64_t n) const {
    Affine a = affine;
    if (a.w) {
      const int64_t bytes = n * (K / 32) * scale_bytes(a.st);
      a.w += n * (K * a.bits / 32), a.scales = static_cast<const char*>(a.scales) + bytes;
      a.biases = static_cast<const char*>(a.biases) + bytes;
    }
    return Matrix{f32 ? f32 + n * K : nullptr, packed ? static_cast<const char*>(packed) + n * packed_width(K, pack) : nullptr,
                  pack, K, a};
  }
  // y[m * N + n] for n in [0, count) of x's M rows (prepared for this matrix's bits: `x`) times
  // this affine matrix's first `count` rows, by the integer forms (QuantRows::span; each row's
  // values those of its own GEMV: quant_linear's)
  void affine_rows(const QuantRows& x, int64_t M, float* y, int64_t N, int64_t count) const {
    x.span(M, affine.w, affine.scales, affine.biases, affine.st, affine.symmetric, y, N, 0, count);
  }
  // its first `rows` rows as float32 (rows x K floats): the weights they were packed from, each
  // fl(fl(d * q) + m) as the grid has them (Grid), so a product of them is that of the weights
  void unpack(int64_t rows, float* out) const {
    if (!packed) return static_cast<void>(std::copy(f32, f32 + rows * K, out));
    with_pack(pack, [&]<Pack P>() { unpack_blocks<P>(packed, rows * (K / kQ4), out); });
  }
  // whether gemv_rows for M rows of x unpacks a packed matrix's rows into its scratch: past a
  // few rows, where unpacking each block again for every pass of rows costs more than unpacking
  // it once; and in the portable build
  static bool unpacks(int64_t M) {
#ifdef MLXTOY_AVX2
    if (cpu_avx2_fma()) return M > kPackedPassRows;
#endif
    return true;
  }
  // y[m * N + n] for n in [0, count) of M rows of x (K floats a row) times this matrix's first
  // `count` rows, each sum gemv_span's chain over the float32 weights (packed or not: the same
  // bits); a packed matrix's rows read as they are (the packed GEMV) or, where `unpacks(M)`,
  // unpacked first into `scratch` (count x K floats) for the several-rows GEMV
  void gemv_rows(const float* x, int64_t M, float* y, int64_t N, int64_t count, float* scratch) const {
    if (f32) return gemv_span(x, f32, y, M, N, K, 0, count, true);
#ifdef MLXTOY_AVX2
    if (!unpacks(M)) {
      const bool avx512 = cpu_avx512();
      return with_pack(pack, [&]<Pack P>() {
        if (avx512) gemv_packed_span_simd<P, true>(x, packed, y, M, N, K, 0, count);
        else gemv_packed_span_simd<P, false>(x, packed, y, M, N, K, 0, count);
      });
    }
#endif
    unpack(count, scratch);
    gemv_span(x, scratch, y, M, N, K, 0, count);
  }
};

}  // namespace

}  // namespace mlxtoy
