// mlxtoy kernels: one query position's attention over a KV cache (decoding), split over the
// cached positions (flash-decoding). A GQA group's query rows go against one part of their KV
// head's positions at a time, so each key and value is read from memory once per token (not
// once per query head), and the parts give a team balanced units however few the KV heads are.
// The parts are fixed by the length alone: any thread count gives the same bits.
// (Included by kernels.cpp and decode.cpp, after loops.h.)
#pragma once

#include <algorithm>
#include <cstdint>

#include "gemv.h"  // gemv_span: a query's scores
#include "loops.h"

namespace mlxtoy {

namespace {

// Positions per part. Measured in the fused decode of SmolLM2 (3 KV heads, 2 threads): parts of
// 64 or 256 positions made the attention slower than parts of 512 at ~1,000 cached positions,
// and no faster at ~200.
constexpr int64_t kAttendPart = 512;

inline int64_t attend_parts(int64_t len) { return std::max<int64_t>(1, (len + kAttendPart - 1) / kAttendPart); }

// What attend_part leaves per query row: the part's largest score m, sum_j e^(s_j - m), and
// sum_j e^(s_j - m) v_j (Dv floats): attend_partial_floats(Dv) floats.
inline int64_t attend_partial_floats(int64_t Dv) { return Dv + 2; }

// The partials of the query rows of KV heads' groups (`group` rows each) over `parts` parts, laid
// out [KV head][part][row of the group]: where KV head kv's part p begins (its group's rows in
// turn), and for query head h (of h / group's group) its first part and the floats between parts.
struct AttendPartials {
  int64_t group, parts, pf;
  int64_t part(int64_t kv, int64_t p) const { return (kv * parts + p) * group * pf; }
  int64_t head(int64_t h) const { return part(h / group, 0) + (h % group) * pf; }
  int64_t stride() const { return group * pf; }
  int64_t floats(int64_t kv_heads) const { return part(kv_heads, 0); }  // the buffer's size
};

#ifdef MLXTOY_AVX2
// sums += e row for a row of 16 C floats; where e is exactly 0 (a masked key) the row is not read
template <int C>
__attribute__((target("avx512f"))) inline void add_weighted_avx512(__m512* sums, float e, const float* row) {
  if (e == 0.0f) return;
  const __m512 ev = _mm512_set1_ps(e);
  for (int c = 0; c < C; ++c) sums[c] = _mm512_fmadd_ps(ev, _mm512_loadu_ps(row + 16 * c), sums[c]);
}

// out = sum_j p[j] v[j] for Dv = 16 C: the sums in registers (two positions a pass into two
// sets, added at the end), where a loop over out in memory waited on its own stores.
template <int C>
__attribute__((target("avx512f"))) inline void weigh_values_avx512(const float* p, const float* v, float* out,
                                                                   int64_t len) {
  __m512 a[C], b[C];
  for (int c = 0; c < C; ++c) a[c] = b[c] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= len; j += 2) {
    add_weighted_avx512<C>(a, p[j], v + j * 16 * C);
    add_weighted_avx512<C>(b, p[j + 1], v + (j + 1) * 16 * C);
  }
  if (j < len) add_weighted_avx512<C>(a, p[j], v + j * 16 * C);
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_add_ps(a[c], b[c]));
}

__attribute__((target("avx512f"))) inline void weigh_values_avx512(const float* p, const float* v, float* out,
                                                                   int64_t len, int64_t Dv) {
  switch (Dv / 16) {
    case 1: return weigh_values_avx512<1>(p, v, out, len);
    case 2: return weigh_values_avx512<2>(p, v, out, len);
    case 3: return weigh_values_avx512<3>(p, v, out, len);
    case 4: return weigh_values_avx512<4>(p, v, out, len);
    case 5: return weigh_values_avx512<5>(p, v, out, len);
    case 6: return weigh_values_avx512<6>(p, v, out, len);
    case 7: return weigh_values_avx512<7>(p, v, out, len);
    default: return weigh_values_avx512<8>(p, v, out, len);
  }
}

// The same with AVX2, for 8 C value floats of a row (C <= 8: the sums and a value vector in
// registers); two sets of sums where they fit (C <= 4), one otherwise.
template <int C>
__attribute__((target("avx2,fma"))) inline void add_weighted_avx2(__m256* sums, float e, const float* row) {
  if (e == 0.0f) return;
  const __m256 ev = _mm256_set1_ps(e);
  for (int c = 0; c < C; ++c) sums[c] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(row + 8 * c), sums[c]);
}

// out[0 : 8 C] = sum_j p[j] v[j][0 : 8 C], the rows Dv floats apart
template <int C>
__attribute__((target("avx2,fma"))) inline void weigh_values_avx2(const float* p, const float* v, float* out,
                                                                 int64_t len, int64_t Dv) {
  __m256 a[C], b[C];
  for (int c = 0; c < C; ++c) a[c] = b[c] = _mm256_setzero_ps();
  int64_t j = 0;
  if (C <= 4)
    for (; j + 2 <= len; j += 2) {
      add_weighted_avx2<C>(a, p[j], v + j * Dv);
      add_weighted_avx2<C>(b, p[j + 1], v + (j + 1) * Dv);
    }
  for (; j < len; ++j) add_weighted_avx2<C>(a, p[j], v + j * Dv);
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_add_ps(a[c], b[c]));
}

// out = sum_j p[j] v[j] for Dv a multiple of 8: 64 columns at a time
__attribute__((target("avx2,fma"))) inline void weigh_values_avx2(const float* p, const float* v, float* out,
                                                                 int64_t len, int64_t Dv) {
  for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
    const float* vc = v + c0;
    float* oc = out + c0;
    switch (std::min<int64_t>(Dv - c0, 64) / 8) {
      case 1: weigh_values_avx2<1>(p, vc, oc, len, Dv); break;
      case 2: weigh_values_avx2<2>(p, vc, oc, len, Dv); break;
      case 3: weigh_values_avx2<3>(p, vc, oc, len, Dv); break;
      case 4: weigh_values_avx2<4>(p, vc, oc, len, Dv); break;
      case 5: weigh_values_avx2<5>(p, vc, oc, len, Dv); break;
      case 6: weigh_values_avx2<6>(p, vc, oc, len, Dv); break;
      case 7: weigh_values_avx2<7>(p, vc, oc, len, Dv); break;
      default: weigh_values_avx2<8>(p, vc, oc, len, Dv); break;
    }
  }
}
#endif

// The AVX-512 forms take value rows of 16 to 128 floats, a multiple of 16; the AVX2 forms rows
// of a multiple of 8 floats.
inline bool attend_avx512(int64_t Dv) {
#ifdef MLXTOY_AVX2
  return cpu_avx512() && Dv % 16 == 0 && Dv > 0 && Dv <= 128;
#else
  return false;
#endif
}

inline bool attend_avx2(int64_t Dv) {
#ifdef MLXTOY_AVX2
  return cpu_avx2_fma() && Dv % 8 == 0 && Dv > 0;
#else
  return false;
#endif
}

// out = sum_j p[j] v[j] (Dv floats a row, the rows Dv apart) in the widest form that applies;
// where p[j] is exactly 0 (a masked key) the row is not read
inline void weigh_values(const float* p, const float* v, float* out, int64_t len, int64_t Dv) {
#ifdef MLXTOY_AVX2
  if (attend_avx512(Dv)) return weigh_values_avx512(p, v, out, len, Dv);
  if (attend_avx2(Dv)) return weigh_values_avx2(p, v, out, len, Dv);
#endif
  std::fill(out, out + Dv, 0.0f);
  for (int64_t j = 0; j < len; ++j) {
    if (p[j] == 0.0f) continue;
    const float e = p[j], *vr = v + j * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) out[d] += e * vr[d];
  }
}

// n query rows (q, n x D: a GQA group) against positions [j0, j1) of their KV head (k, v: the
// head's rows from position 0), bias (0 or -inf per position) optional; per row r, its partial
// into partial + r * attend_partial_floats(Dv). scores: n * kAttendPart floats of scratch.
HOT void attend_part(const float* q, int64_t n, const float* k, const float* v, const float* bias, int64_t j0,
                     int64_t j1, int64_t D, int64_t Dv, float scale, float* scores, float* partial) {
  const int64_t len = j1 - j0;
  k += j0 * D;
  v += j0 * Dv;
  // scores[r * len + j] = q_r . k_j: the several-rows GEMV, four keys a pass, each read once for
  // the group's rows
  gemv_span(q, k, scores, n, len, D, 0, len);
  for (int64_t r = 0; r < n; ++r) {
    float* s = scores + r * len;
    float* out = partial + r * attend_partial_floats(Dv);
    float m = kNegInf;
    for (int64_t j = 0; j < len; ++j) {
      s[j] = s[j] * scale + (bias ? bias[j0 + j] : 0.0f);
      m = std::max(m, s[j]);
    }
    float sum = 0.0f;
    const ExpRange range = exp_range();
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; ++j) {
      s[j] = masked_exp(s[j], m, range);  // all 0 where every key is masked (m = -inf)
      sum += s[j];
    }
    out[0] = m;
    out[1] = sum;
    weigh_values(s, v, out + 2, len, Dv);
  }
}

// One query row's attention output (Dv) from the partials of its P parts (`stride` floats
// apart): out = sum_p w_p acc_p / sum_p w_p sum_p, w_p = e^(m_p - max m); zeros where every
// key was masked, as the softmax kernel gives.
HOT void attend_combine(const float* partials, int64_t P, int64_t stride, int64_t Dv, float* out) {
  float m = kNegInf;
  for (int64_t p = 0; p < P; ++p) m = std::max(m, partials[p * stride]);
  std::fill(out, out + Dv, 0.0f);
  if (m == kNegInf) return;
  float total = 0.0f;
  for (int64_t p = 0; p < P; ++p) {
    const float* part = partials + p * stride;
    const float w = masked_exp(part[0], m, exp_range());
    if (w == 0.0f) continue;
    total += w * part[1];
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) out[d] += w * part[2 + d];
  }
  const float inv = 1.0f / total;
#pragma omp simd
  for (int64_t d = 0; d < Dv; ++d) out[d] *= inv;
}

}  // namespace

}  // namespace mlxtoy
