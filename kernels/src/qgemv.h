// The fused quantized GEMV of decoding (qgemv.cpp): y = x W^T for a few rows of x and a W in
// MLX's affine quantized layout, read as it is (kernels/README.md, "Quantized bases").

#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"
#include "pool.h"

namespace mlxtoy {

namespace mx = mlx::core;

constexpr int64_t kGemvRows = 4;
constexpr int64_t kChunk = 32;  // weights a step of the loops (16 bytes at 4 bits, 32 at 8)
constexpr int64_t kVnniBlock = 128;  // weights of a row a block: 4 groups of 32
// a row's VNNI blocks: the last one partial where K is not a whole number of blocks (SmolLM2's 576
// and 960 are 4.5 and 7.5), its missing groups read as zeros
constexpr int64_t vnni_blocks(int64_t K) { return (K + kVnniBlock - 1) / kVnniBlock; }
// Up to this many rows of x (a prompt, at inference) the VNNI form, compute-bound past a few rows,
// may beat dequantizing slabs for the SGEMM (docs/performance.md, "Decoding from a quantized
// base"), and the AVX2 integer form, compute-bound sooner (even with the slabs near 48 rows on a
// Zen 3): the bounds of what `quant.quant_linear` measures against the slabs per rows class
constexpr int64_t kVnniMaxRows = 256;
constexpr int64_t kX16MaxRows = 128;
// and the float32 form (where no integer form runs: groups of 64, 8 bits without VNNI), a pass of
// kGemvRows rows of x at a time, W's block of rows read from cache past the first: a batch of
// decoded rows against an 8-bit output layer, which the slabs widened whole every step
// (docs/performance.md)
constexpr int64_t kFloatMaxRows = 64;

enum class ScaleType { F32, F16, BF16 };

// bytes of one scale (or bias) of type t
constexpr int64_t scale_bytes(ScaleType t) { return t == ScaleType::F32 ? 4 : 2; }

inline ScaleType scale_type(const mx::array& a) {
  return a.dtype() == mx::float16 ? ScaleType::F16 : a.dtype() == mx::bfloat16 ? ScaleType::BF16 : ScaleType::F32;
}

// whether the 4- and 8-bit GEMV (groups of 32) takes AVX-512 VNNI here; MLXTOY_KERNEL_VNNI=0: no
bool cpu_vnni();

// whether the 4-bit GEMV's AVX2 16-bit integer form runs here (for groups of 32 where VNNI does not)
bool cpu_x16();

// whether qgemv takes the VNNI form for this W (4 or 8 bits, groups of 32, and the CPU):
// the form that takes any number of rows of x
bool vnni_form(int64_t K, int64_t group, int bits);

// the most rows of x that qgemv takes for this W at inference (a prompt's): kGemvRows, or more in
// the VNNI and the AVX2 integer forms
int64_t gemv_max_rows(int64_t K, int64_t group, int bits);

// whether qgemv takes an integer form for this W (groups of 32 and the CPU: VNNI at 4 or 8 bits, else
// AVX2's at 4):
// x rounded to 16 bits a group, a form that `QuantRows` prepares
bool integer_form(int64_t K, int64_t group, int bits);

// Rows of x prepared once for the integer forms (`integer_form`'s W), then multiplied by any range
// of W's rows on any thread: qgemv's own products, and the fused decode block's 4-bit matrices
// (decode.cpp), which so give the bits of quant_linear's GEMV
class QuantRows {
 public:
  // room for M rows of K against a W `bits` wide (4, or 8 in the VNNI form); then `prepare` rows
  // [m0, m1) of x (M, K), disjoint ranges on any threads
  void reserve(int64_t M, int64_t K, int bits = 4);
  void prepare(const float* x, int64_t m0, int64_t m1);
  // y[m * N + n] = x[m0 + m] . W[n] for m < count (at most kGemvRows) and n in [n0, n1); W (N, K)
  // `reserve`'s bits in groups of 32, scales and biases (N, K / 32) of type st (symmetric: biases not read)
  void products(int64_t m0, int64_t count, const uint32_t* w, const void* scales, const void* biases, ScaleType st,
                bool symmetric, float* y, int64_t N, int64_t n0, int64_t n1) const;
  // the same for all M prepared rows: at once up to kGemvRows (decoding), else (a prompt) over tiles
  // of 16 rows of W, each multiplied by passes of the form's rows of x while it is in cache, so W
  // is still read from memory once
  void span(int64_t M, const uint32_t* w, const void* scales, const void* biases, ScaleType st, bool symmetric,
            float* y, int64_t N, int64_t n0, int64_t n1) const;

 private:
  bool vnni_ = false;
  int64_t K_ = 0;
  int bits_ = 4;
  std::vector<float> sums_, steps_, xsl_;  // group sums; AVX2: each group's step; VNNI: its layout's
  std::vector<int16_t> x16_;
  std::vector<int8_t> bytes_;
  std::vector<int32_t> corr_;
};

// y (M, N) = x (M, K) W^T, W's rows split over `threads`; M <= kGemvRows, or M <= gemv_max_rows at
// inference; symmetric: the biases are -2^(bits - 1) scales and need not be read
void qgemv(const float* x, int64_t M, const uint32_t* w, const void* scales, const void* biases, ScaleType st,
           bool symmetric, float* y, int64_t N, int64_t K, int64_t group, int bits, Pool& threads);

}  // namespace mlxtoy
