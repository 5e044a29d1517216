// mlxtoy kernels: Y = X W^T in float32 with AVX-512, for prefill (included by kernels.cpp).
//
// Computed as Y^T = W X^T: a tile is kGemmRows rows of W (each weight broadcast) times a panel of
// 32 rows of X laid out k-major (two 16-float vectors per k), so the inner loop is 2 vector
// loads, kGemmRows broadcasts and 2 kGemmRows FMAs, with W read in place (no copy of the weights)
// and only X, the small operand, repacked. Used where the BLAS has no AVX-512 GEMM of its own
// (see fastmath.linear), never for gradients.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace mlxtoy {

constexpr int64_t kGemmPanel = 32;  // rows of X per panel
constexpr int kGemmRows = 12;       // rows of W per tile: 24 accumulators of the 32 registers
constexpr int64_t kGemmChunk = 128;  // rows of X packed at a time (their panels stay in L2)

inline bool gemm_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
using AlignedFloats = std::unique_ptr<float[], AlignedFree>;

inline AlignedFloats aligned_floats(int64_t n) {
  size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
  return AlignedFloats(static_cast<float*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64))));
}

// rows [0, mp) of x (mp <= 32, row stride K) as one panel: panel[k * 32 + i] = x[i][k], 0 for i >= mp
inline void gemm_pack_panel(const float* x, int64_t K, int64_t mp, float* panel) {
  for (int64_t k0 = 0; k0 < K; k0 += 64)  // 64 columns at a time: the 32 source rows' lines stay in L1
    for (int64_t i = 0; i < kGemmPanel; ++i) {
      const float* row = x + i * K;
      for (int64_t k = k0; k < std::min(K, k0 + 64); ++k) panel[k * kGemmPanel + i] = i < mp ? row[k] : 0.0f;
    }
}

// t[r][i] = sum_k w[r][k] panel[k][i] for R rows of w (row stride K)
template <int R>
__attribute__((target("avx512f"))) inline void gemm_tile(const float* panel, const float* w, int64_t K, float* t) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 x0 = _mm512_load_ps(panel + k * kGemmPanel), x1 = _mm512_load_ps(panel + k * kGemmPanel + 16);
    for (int r = 0; r < R; ++r) {
      __m512 b = _mm512_set1_ps(w[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(b, x0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(b, x1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(t + r * kGemmPanel, acc[r][0]);
    _mm512_store_ps(t + r * kGemmPanel + 16, acc[r][1]);
  }
}

template <int R>
inline void gemm_tile_rows(const float* panel, const float* w, int64_t K, int rows, float* t) {
  if constexpr (R > 1) {
    if (rows < R) return gemm_tile_rows<R - 1>(panel, w, K, rows, t);
  }
  gemm_tile<R>(panel, w, K, t);
}

// y[i][n0 + r] (row stride N) for the panel's mp rows and rows [n0, n1) of w (n1 - n0 <= kGemmRows)
inline void gemm_panel_rows(const float* panel, int64_t mp, const float* w, int64_t K, float* y, int64_t N,
                            int64_t n0, int64_t n1) {
  alignas(64) float t[kGemmRows * kGemmPanel];
  int rows = static_cast<int>(n1 - n0);
  gemm_tile_rows<kGemmRows>(panel, w + n0 * K, K, rows, t);
  for (int64_t i = 0; i < mp; ++i)
    for (int r = 0; r < rows; ++r) y[i * N + n0 + r] = t[r * kGemmPanel + i];
}

}  // namespace mlxtoy
