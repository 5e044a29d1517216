// The CBLAS GEMM MLX itself calls (the optimized BLAS mlxtoy loads first, where there is one),
// row-major (included by attention.cpp and quant.cpp).
#pragma once

#include <cstdint>

extern "C" void cblas_sgemm(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                            int lda, const float* b, int ldb, float beta, float* c, int ldc);

namespace mlxtoy {

// c (m, n; row stride ldc) = alpha op(a) op(b) + beta c, row-major
inline void blas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
  cblas_sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb),
              beta, c, static_cast<int>(ldc));
}

}  // namespace mlxtoy
