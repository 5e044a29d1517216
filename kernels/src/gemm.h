// mlxtoy kernels: a float32 GEMM with AVX-512 (included by kernels.cpp).
//
// out[i, j] = sum_s A(i, s) B(j, s), each operand read through its strides, so one loop serves
// x W^T (the forward), dY W (the input's gradient) and dY^T X (the weight's). A tile is
// kGemmRows rows of B, each element broadcast, times a panel of 32 rows of A laid out s-major
// (two 16-float vectors per s): the inner loop is 2 vector loads, kGemmRows broadcasts and
// 2 kGemmRows FMAs. B, the weight in the forward, is read in place; only A is repacked, a
// kGemmChunk-row slice at a time so its panels stay in L2. Each output is one tile's sum in
// s order (a long sum's blocks added in order), whichever thread computes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <vector>

#include "loops.h"  // MLXTOY_AVX2 (x86-64 intrinsics) and cpu_avx512
#include "pool.h"

// the AVX-512 code on x86-64 only (MLXTOY_NO_AVX512: the portable stubs, to check that they build)
#if defined(MLXTOY_AVX2) && !defined(MLXTOY_NO_AVX512)
#define MLXTOY_GEMM_AVX512 1
#endif

namespace mlxtoy {

// element (i, s) at p[i * row + s * red]
struct GemmOperand {
  const float* p;
  int64_t row, red;
};

// One GEMM's B rows, to be handed out by tile: rows [0, N) of b, out[i * ors + j * ocs].
struct GemmTarget {
  GemmOperand b;
  int64_t N;
  float* out;
  int64_t ors, ocs;
};

#ifndef MLXTOY_GEMM_AVX512
inline bool gemm_avx512() { return false; }
inline void gemm_run(Pool&, GemmOperand, int64_t, int64_t, const std::vector<GemmTarget>&) {
  throw std::runtime_error("[mlxtoy_kernels] the GEMM kernel needs an x86-64 CPU with AVX-512");
}
#else

constexpr int64_t kGemmPanel = 32;  // rows of A per panel
constexpr int kGemmRows = 12;       // rows of B per tile: 24 accumulators of the 32 registers
constexpr int64_t kGemmChunk = 128;  // rows of A packed at a time
constexpr int64_t kGemmLongSum = 2048;  // sums over more s than this run in blocks of at most kGemmDepth
constexpr int64_t kGemmDepth = 512;

inline bool gemm_avx512() { return cpu_avx512(); }

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};

// rows [0, mp) of a (mp <= 32) over s in [0, S) as one panel: panel[s * 32 + i] = A(i, s), 0 for i >= mp
inline void gemm_pack_panel(GemmOperand a, int64_t S, int64_t mp, float* panel) {
  if (a.row == 1) {  // the panel's rows are contiguous for each s
    for (int64_t s = 0; s < S; ++s) {
      const float* src = a.p + s * a.red;
      float* dst = panel + s * kGemmPanel;
      std::copy(src, src + mp, dst);
      std::fill(dst + mp, dst + kGemmPanel, 0.0f);
    }
    return;
  }
  for (int64_t s0 = 0; s0 < S; s0 += 64)  // 64 columns at a time: the source rows' lines stay in L1
    for (int64_t i = 0; i < kGemmPanel; ++i)
      for (int64_t s = s0; s < std::min(S, s0 + 64); ++s)
        panel[s * kGemmPanel + i] = i < mp ? a.p[i * a.row + s * a.red] : 0.0f;
}

// out[i * ors + r * ocs] for the panel's mp rows i and R rows r of b; b_rows_along_s: b.red == 1
template <int R, bool b_rows_along_s>
__attribute__((target("avx512f"))) inline void gemm_tile(const float* panel, GemmOperand b, int64_t S, int64_t mp,
                                                         float* out, int64_t ors, int64_t ocs, bool add) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m512 x0 = _mm512_load_ps(panel + s * kGemmPanel), x1 = _mm512_load_ps(panel + s * kGemmPanel + 16);
    for (int r = 0; r < R; ++r) {
      __m512 w = _mm512_set1_ps(b_rows_along_s ? b.p[r * b.row + s] : b.p[s * b.red + r * b.row]);
      acc[r][0] = _mm512_fmadd_ps(w, x0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w, x1, acc[r][1]);
    }
  }
  if (ors == 1) {  // each accumulator's 16 rows i are contiguous in out
    __mmask16 lo = static_cast<__mmask16>(mp >= 16 ? 0xffff : (1u << mp) - 1);
    __mmask16 hi = static_cast<__mmask16>(mp >= 32 ? 0xffff : mp <= 16 ? 0 : (1u << (mp - 16)) - 1);
    for (int r = 0; r < R; ++r) {
      if (add) {
        acc[r][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(lo, out + r * ocs), acc[r][0]);
        acc[r][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(hi, out + r * ocs + 16), acc[r][1]);
      }
      _mm512_mask_storeu_ps(out + r * ocs, lo, acc[r][0]);
      _mm512_mask_storeu_ps(out + r * ocs + 16, hi, acc[r][1]);
    }
    return;
  }
  alignas(64) float t[R * kGemmPanel];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(t + r * kGemmPanel, acc[r][0]);
    _mm512_store_ps(t + r * kGemmPanel + 16, acc[r][1]);
  }
  for (int64_t i = 0; i < mp; ++i)
    for (int r = 0; r < R; ++r) {
      float v = t[r * kGemmPanel + i];
      out[i * ors + r * ocs] = add ? out[i * ors + r * ocs] + v : v;
    }
}

template <int R, bool b_rows_along_s>
inline void gemm_tile_rows(const float* panel, GemmOperand b, int64_t S, int64_t mp, int rows, float* out,
                           int64_t ors, int64_t ocs, bool add) {
  if constexpr (R > 1) {
    if (rows < R) return gemm_tile_rows<R - 1, b_rows_along_s>(panel, b, S, mp, rows, out, ors, ocs, add);
  }
  gemm_tile<R, b_rows_along_s>(panel, b, S, mp, out, ors, ocs, add);
}

// out[i, j] = sum_s A(i, s) B(j, s) for i < M and each target's j < N (the targets share A:
// a layer's q, k and v), split over the pool's threads.
inline void gemm_run(Pool& threads, GemmOperand a, int64_t M, int64_t S, const std::vector<GemmTarget>& targets) {
  if (S == 0) {  // an empty sum: zeros, as MLX's matmul gives
    for (const auto& t : targets)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < t.N; ++j) t.out[i * t.ors + j * t.ocs] = 0.0f;
    return;
  }
  std::vector<int64_t> first_block{0};
  for (const auto& t : targets) first_block.push_back(first_block.back() + (t.N + kGemmRows - 1) / kGemmRows);
  const int64_t blocks = first_block.back();
  // a long sum (the vocabulary's, in the loss's input gradient) in equal blocks: the panels and a
  // tile's rows of B then stay in cache; the layers' sums (up to 2048) in one
  const int64_t kc = S <= kGemmLongSum ? S : (S + (S + kGemmDepth - 1) / kGemmDepth - 1) / ((S + kGemmDepth - 1) / kGemmDepth);
  const size_t bytes = (static_cast<size_t>(kGemmChunk * kc) * sizeof(float) + 63) / 64 * 64;
  std::unique_ptr<float[], AlignedFree> panels(static_cast<float*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64))));
  for (int64_t m0 = 0; m0 < M; m0 += kGemmChunk)
    for (int64_t s0 = 0; s0 < S; s0 += kc) {  // the sums over s in blocks of kc, added in order
      const int64_t mc = std::min(kGemmChunk, M - m0), n_panels = (mc + kGemmPanel - 1) / kGemmPanel;
      const int64_t sc = std::min(kc, S - s0);
      threads.run(n_panels, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
          gemm_pack_panel({a.p + (m0 + p * kGemmPanel) * a.row + s0 * a.red, a.row, a.red}, sc,
                          std::min(kGemmPanel, mc - p * kGemmPanel), panels.get() + p * kGemmPanel * sc);
      });
      threads.run_dynamic(blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t blk = b0; blk < b1; ++blk) {
          size_t ti = std::upper_bound(first_block.begin(), first_block.end(), blk) - first_block.begin() - 1;
          const GemmTarget& t = targets[ti];
          int64_t j0 = (blk - first_block[ti]) * kGemmRows;
          int rows = static_cast<int>(std::min<int64_t>(kGemmRows, t.N - j0));
          GemmOperand b{t.b.p + j0 * t.b.row + s0 * t.b.red, t.b.row, t.b.red};
          for (int64_t p = 0; p < n_panels; ++p) {
            int64_t i0 = m0 + p * kGemmPanel, mp = std::min(kGemmPanel, mc - p * kGemmPanel);
            float* out = t.out + i0 * t.ors + j0 * t.ocs;
            const float* panel = panels.get() + p * kGemmPanel * sc;
            if (b.red == 1)
              gemm_tile_rows<kGemmRows, true>(panel, b, sc, mp, rows, out, t.ors, t.ocs, s0 > 0);
            else
              gemm_tile_rows<kGemmRows, false>(panel, b, sc, mp, rows, out, t.ors, t.ocs, s0 > 0);
          }
        }
      });
    }
}

#endif  // MLXTOY_GEMM_AVX512

}  // namespace mlxtoy
