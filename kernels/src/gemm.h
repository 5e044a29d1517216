// mlxtoy kernels: a float32 GEMM with AVX-512, or AVX2 and FMA (included by kernels.cpp).
//
// out[i, j] = sum_s A(i, s) B(j, s), each operand read through its strides, so one loop serves
// x W^T (the forward), dY W (the input's gradient) and dY^T X (the weight's). A tile is
// `rows` rows of B, each element broadcast, times a panel of `panel` rows of A laid out s-major
// (two vectors per s): the inner loop is 2 vector loads, `rows` broadcasts and 2 `rows` FMAs.
// AVX-512: 32-row panels, 12 rows of B (24 accumulators of its 32 registers); AVX2: 16-row
// panels, 6 rows of B (12 accumulators of its 16). B, the weight in the forward, is read in
// place; only A is repacked, a `chunk`-row slice at a time so its panels stay in L2. Each output
// is one tile's sum in s order (a long sum's blocks added in order), whichever thread computes
// it; the two ISAs' sums differ in order, so a machine's results depend on which it has.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <vector>

#include "loops.h"  // MLXTOY_AVX2 (x86-64 intrinsics), cpu_avx512 and cpu_avx2_fma
#include "pool.h"

// the x86 code on x86-64 only (MLXTOY_NO_AVX512: the portable stubs, to check that they build)
#if defined(MLXTOY_AVX2) && !defined(MLXTOY_NO_AVX512)
#define MLXTOY_GEMM_X86 1
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

#ifndef MLXTOY_GEMM_X86
inline bool gemm_x86() { return false; }
inline void gemm_run(Pool&, GemmOperand, int64_t, int64_t, const std::vector<GemmTarget>&) {
  throw std::runtime_error("[mlxtoy_kernels] the GEMM kernel needs an x86-64 CPU with AVX-512 or AVX2 and FMA");
}
#else

// whether the GEMM runs here: AVX-512, else AVX2 with FMA
inline bool gemm_x86() { return cpu_avx512() || cpu_avx2_fma(); }

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};

// 8 x 8 floats transposed: rows[i] (8 floats of row i) to cols[j * stride + i]
__attribute__((target("avx2"))) inline void transpose8(const __m256 (&rows)[8], float* cols, int64_t stride) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(rows[i], rows[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_store_ps(cols + j * stride, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
    _mm256_store_ps(cols + (j + 4) * stride, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
  }
}

// the panel's columns s < S / 8 * 8 from rows of a along s (a.red == 1); returns the first s left
template <int64_t P>
__attribute__((target("avx2"))) inline int64_t gemm_pack_rows_avx2(GemmOperand a, int64_t S, int64_t mp, float* panel) {
  int64_t s0 = 0;
  for (; s0 + 8 <= S; s0 += 8)
    for (int64_t i0 = 0; i0 < P; i0 += 8) {
      __m256 rows[8];
      for (int i = 0; i < 8; ++i)
        rows[i] = i0 + i < mp ? _mm256_loadu_ps(a.p + (i0 + i) * a.row + s0) : _mm256_setzero_ps();
      transpose8(rows, panel + s0 * P + i0, P);
    }
  return s0;
}

// rows [0, mp) of a (mp <= P) over s in [0, S) as one panel: panel[s * P + i] = A(i, s), 0 for i >= mp
template <int64_t P>
inline void gemm_pack_panel(GemmOperand a, int64_t S, int64_t mp, float* panel) {
  if (a.row == 1) {  // the panel's rows are contiguous for each s
    for (int64_t s = 0; s < S; ++s) {
      const float* src = a.p + s * a.red;
      float* dst = panel + s * P;
      std::copy(src, src + mp, dst);
      std::fill(dst + mp, dst + P, 0.0f);
    }
    return;
  }
  // rows along s (the forward's x): 8 x 8 blocks transposed in registers, the tail as below
  int64_t s0 = a.red == 1 && cpu_avx2() ? gemm_pack_rows_avx2<P>(a, S, mp, panel) : 0;
  for (; s0 < S; s0 += 64)  // 64 columns at a time: the source rows' lines stay in L1
    for (int64_t i = 0; i < P; ++i)
      for (int64_t s = s0; s < std::min(S, s0 + 64); ++s)
        panel[s * P + i] = i < mp ? a.p[i * a.row + s * a.red] : 0.0f;
}

// a tile's accumulators (R rows of B, two vectors of panel rows each) written to out[i * ors + r * ocs]
// for the mp panel rows i, added to what is there with `add`: through a buffer where the rows i
// are not contiguous in out
template <int64_t P, int R>
inline void gemm_store_strided(const float* t, int64_t mp, float* out, int64_t ors, int64_t ocs, bool add) {
  for (int64_t i = 0; i < mp; ++i)
    for (int r = 0; r < R; ++r) {
      float v = t[r * P + i];
      out[i * ors + r * ocs] = add ? out[i * ors + r * ocs] + v : v;
    }
}

// out[i * ors + r * ocs] for the panel's mp rows i and R rows r of b; b_rows_along_s: b.red == 1
template <int R, bool b_rows_along_s>
__attribute__((target("avx512f"))) inline void gemm_tile_avx512(const float* panel, GemmOperand b, int64_t S,
                                                                int64_t mp, float* out, int64_t ors, int64_t ocs,
                                                                bool add) {
  constexpr int64_t P = 32;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m512 x0 = _mm512_load_ps(panel + s * P), x1 = _mm512_load_ps(panel + s * P + 16);
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
  alignas(64) float t[R * P];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(t + r * P, acc[r][0]);
    _mm512_store_ps(t + r * P + 16, acc[r][1]);
  }
  gemm_store_strided<P, R>(t, mp, out, ors, ocs, add);
}

// the same tile with AVX2 and FMA: 16-row panels (two 8-float vectors). The accumulators are
// read only in fully unrolled loops: with masked stores reading them, GCC kept them in memory
// and stored all twelve every step.
template <int R, bool b_rows_along_s>
__attribute__((target("avx2,fma"))) inline void gemm_tile_avx2(const float* panel, GemmOperand b, int64_t S,
                                                               int64_t mp, float* out, int64_t ors, int64_t ocs,
                                                               bool add) {
  constexpr int64_t P = 16;
  __m256 acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m256 x0 = _mm256_load_ps(panel + s * P), x1 = _mm256_load_ps(panel + s * P + 8);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m256 w = _mm256_broadcast_ss(b_rows_along_s ? b.p + r * b.row + s : b.p + s * b.red + r * b.row);
      acc[r][0] = _mm256_fmadd_ps(w, x0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w, x1, acc[r][1]);
    }
  }
  if (ors == 1 && mp == P) {  // each accumulator's 16 rows i are contiguous in out
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (add) {
        acc[r][0] = _mm256_add_ps(_mm256_loadu_ps(out + r * ocs), acc[r][0]);
        acc[r][1] = _mm256_add_ps(_mm256_loadu_ps(out + r * ocs + 8), acc[r][1]);
      }
      _mm256_storeu_ps(out + r * ocs, acc[r][0]);
      _mm256_storeu_ps(out + r * ocs + 8, acc[r][1]);
    }
    return;
  }
  alignas(32) float t[R * P];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(t + r * P, acc[r][0]);
    _mm256_store_ps(t + r * P + 8, acc[r][1]);
  }
  gemm_store_strided<P, R>(t, mp, out, ors, ocs, add);
}

// The blocking of each ISA: rows of A a panel holds, rows of B a tile holds, rows of A packed at
// a time (their panels stay in L2), the blocks a long sum runs in (a tile's panel and rows of B
// then stay in cache), and whether the threads split many rows of A between them (each packing
// its own chunks, kept in its core's L2) rather than the tiles of B (sharing A's panels). The
// AVX2 blocking is the best of those tried on a Zen 3 (kernels/README.md); pack_b: a B stored
// s-major is copied tile by tile (below). The AVX-512 form keeps the blocking it was measured with
// on AVX-512 CPUs: B read in place, the threads sharing A's panels.
struct GemmAvx512 {
  static constexpr int64_t panel = 32, chunk = 128, long_sum = 2048, depth = 512;
  static constexpr int rows = 12;
  static constexpr bool split_rows = false, pack_b = false;
  template <int R, bool along>
  static void tile(const float* p, GemmOperand b, int64_t S, int64_t mp, float* out, int64_t ors, int64_t ocs, bool add) {
    gemm_tile_avx512<R, along>(p, b, S, mp, out, ors, ocs, add);
  }
};

struct GemmAvx2 {
  static constexpr int64_t panel = 16, chunk = 64, long_sum = 512, depth = 512;
  static constexpr int rows = 6;
  static constexpr bool split_rows = true, pack_b = true;
  template <int R, bool along>
  static void tile(const float* p, GemmOperand b, int64_t S, int64_t mp, float* out, int64_t ors, int64_t ocs, bool add) {
    gemm_tile_avx2<R, along>(p, b, S, mp, out, ors, ocs, add);
  }
};

// a tile of `rows` (<= R) rows of B
template <class Isa, int R, bool along>
inline void gemm_tile_rows(const float* panel, GemmOperand b, int64_t S, int64_t mp, int rows, float* out,
                           int64_t ors, int64_t ocs, bool add) {
  if constexpr (R > 1) {
    if (rows < R) return gemm_tile_rows<Isa, R - 1, along>(panel, b, S, mp, rows, out, ors, ocs, add);
  }
  Isa::template tile<R, along>(panel, b, S, mp, out, ors, ocs, add);
}

// n floats, 64-byte aligned (at least one line)
inline std::unique_ptr<float[], AlignedFree> gemm_floats(size_t n) {
  return std::unique_ptr<float[], AlignedFree>(
      static_cast<float*>(std::aligned_alloc(64, std::max<size_t>((n * sizeof(float) + 63) / 64 * 64, 64))));
}

// this thread's aligned scratch of at least n floats (kept for its next call)
inline float* gemm_scratch(size_t n) {
  thread_local std::unique_ptr<float[], AlignedFree> buf;
  thread_local size_t size = 0;
  if (n > size) {
    size = std::max(n, size * 2);
    buf = gemm_floats(size);
  }
  return buf.get();
}

template <class Isa>
inline void gemm_run_isa(Pool& threads, GemmOperand a, int64_t M, int64_t S, const std::vector<GemmTarget>& targets) {
  constexpr int64_t P = Isa::panel;
  constexpr int R = Isa::rows;
  constexpr int64_t CH = Isa::chunk;
  std::vector<int64_t> first_block{0};
  for (const auto& t : targets) first_block.push_back(first_block.back() + (t.N + R - 1) / R);
  const int64_t blocks = first_block.back();
  // a long sum (the vocabulary's, in the loss's input gradient) in equal blocks
  const int64_t n_sums = (S + Isa::depth - 1) / Isa::depth;
  const int64_t kc = S <= Isa::long_sum ? S : (S + n_sums - 1) / n_sums;
  auto panels = gemm_floats(static_cast<size_t>(CH * kc));
  // B stored s-major (the gradients' forms): a tile's R floats of each s sit in one line with the
  // next tiles', so a kc block of B is copied once, tile by tile, [s][r], and read from L1
  const bool pack_b = Isa::pack_b && M > P &&
                      std::all_of(targets.begin(), targets.end(), [](const GemmTarget& t) { return t.b.red != 1; });
  auto packed_b = gemm_floats(pack_b ? static_cast<size_t>(blocks * kc * R) : 0);
  auto tile_b = [&](int64_t blk, int64_t s0, int64_t sc, const GemmTarget*& t, int64_t& j0, int& rows) {
    size_t ti = std::upper_bound(first_block.begin(), first_block.end(), blk) - first_block.begin() - 1;
    t = &targets[ti];
    j0 = (blk - first_block[ti]) * R;
    rows = static_cast<int>(std::min<int64_t>(R, t->N - j0));
    return GemmOperand{t->b.p + j0 * t->b.row + s0 * t->b.red, t->b.row, t->b.red};
  };
  for (int64_t s0 = 0; s0 < S; s0 += kc) {  // the sums over s in blocks of kc, added in order
    const int64_t sc = std::min(kc, S - s0);
    if (pack_b)
      threads.run(blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t blk = b0; blk < b1; ++blk) {
          const GemmTarget* t;
          int64_t j0;
          int rows;
          GemmOperand b = tile_b(blk, s0, sc, t, j0, rows);
          float* dst = packed_b.get() + blk * sc * R;
          for (int64_t s = 0; s < sc; ++s)
            for (int r = 0; r < R; ++r) dst[s * R + r] = r < rows ? b.p[s * b.red + r * b.row] : 0.0f;
        }
      });
    auto tiles = [&](int64_t m0, int64_t mc, const float* panels, int64_t b0, int64_t b1) {
      const int64_t n_panels = (mc + P - 1) / P;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const GemmTarget* t;
        int64_t j0;
        int rows;
        GemmOperand b = tile_b(blk, s0, sc, t, j0, rows);
        if (pack_b) b = {packed_b.get() + blk * sc * R, 1, R};
        for (int64_t p = 0; p < n_panels; ++p) {
          int64_t i0 = m0 + p * P, mp = std::min(P, mc - p * P);
          float* out = t->out + i0 * t->ors + j0 * t->ocs;
          const float* panel = panels + p * P * sc;
          if (b.red == 1)
            gemm_tile_rows<Isa, R, true>(panel, b, sc, mp, rows, out, t->ors, t->ocs, s0 > 0);
          else
            gemm_tile_rows<Isa, R, false>(panel, b, sc, mp, rows, out, t->ors, t->ocs, s0 > 0);
        }
      }
    };
    auto pack_a = [&](int64_t m0, int64_t mc, float* panels, int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        gemm_pack_panel<P>({a.p + (m0 + p * P) * a.row + s0 * a.red, a.row, a.red}, sc, std::min(P, mc - p * P),
                           panels + p * P * sc);
    };
    const int64_t n_chunks = (M + CH - 1) / CH;
    if (Isa::split_rows && n_chunks >= 2 * threads.threads()) {
      // many rows: each thread packs its own chunks of A (its panels stay in its core's L2) and
      // runs them against every tile of B, which the cores share
      threads.run_dynamic(n_chunks, 1, [&](int64_t c0, int64_t c1) {
        float* own = gemm_scratch(static_cast<size_t>(CH * sc));
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t m0 = c * CH, mc = std::min(CH, M - m0);
          pack_a(m0, mc, own, 0, (mc + P - 1) / P);
          tiles(m0, mc, own, 0, blocks);
        }
      });
      continue;
    }
    for (int64_t m0 = 0; m0 < M; m0 += CH) {
      const int64_t mc = std::min(CH, M - m0), n_panels = (mc + P - 1) / P;
      threads.run(n_panels, 1, [&](int64_t p0, int64_t p1) { pack_a(m0, mc, panels.get(), p0, p1); });
      threads.run_dynamic(blocks, 1, [&](int64_t b0, int64_t b1) { tiles(m0, mc, panels.get(), b0, b1); });
    }
  }
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
  if (cpu_avx512()) return gemm_run_isa<GemmAvx512>(threads, a, M, S, targets);
  if (cpu_avx2_fma()) return gemm_run_isa<GemmAvx2>(threads, a, M, S, targets);
  throw std::runtime_error("[mlxtoy_kernels] the GEMM kernel needs an x86-64 CPU with AVX-512 or AVX2 and FMA");
}

#endif  // MLXTOY_GEMM_X86

}  // namespace mlxtoy
