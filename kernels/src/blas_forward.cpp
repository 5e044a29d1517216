// libmlxtoy_blas: the CBLAS GEMMs MLX calls (cblas_sgemm, cblas_dgemm, cblas_cgemm), forwarded
// to an OpenBLAS whose symbols carry a prefix (PyPI's scipy-openblas32: scipy_cblas_sgemm, ...).
// MLX's Linux wheel resolves those names to whatever library with global symbols was loaded
// first; this one has no MLX dependency, so mlxtoy.backend can load it before mlx.core:
// mlxtoy_blas_bind() opens the OpenBLAS privately, and only once it has bound every function is
// this library promoted to global symbols (a failed bind leaves MLX on its own BLAS).

#include <dlfcn.h>

#include <string>

namespace {

using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                       int);
using Dgemm = void (*)(int, int, int, int, int, int, double, const double*, int, const double*, int, double,
                       double*, int);
using Cgemm = void (*)(int, int, int, int, int, int, const void*, const void*, int, const void*, int, const void*,
                       void*, int);
using SetThreads = void (*)(int);
using GetThreads = int (*)();

Sgemm sgemm = nullptr;
Dgemm dgemm = nullptr;
Cgemm cgemm = nullptr;
SetThreads set_threads = nullptr;
GetThreads get_threads = nullptr;

template <typename F>
bool bind(void* lib, const std::string& name, F& out) {
  out = reinterpret_cast<F>(dlsym(lib, name.c_str()));
  return out != nullptr;
}

}  // namespace

extern "C" {

// Opens `path` and binds the functions `prefix` + their CBLAS names: 0 when every one was found.
int mlxtoy_blas_bind(const char* path, const char* prefix) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return 1;
  const std::string p = prefix;
  bool ok = bind(lib, p + "cblas_sgemm", sgemm) && bind(lib, p + "cblas_dgemm", dgemm) &&
            bind(lib, p + "cblas_cgemm", cgemm) && bind(lib, p + "openblas_set_num_threads", set_threads) &&
            bind(lib, p + "openblas_get_num_threads", get_threads);
  return ok ? 0 : 2;
}

// The BLAS's thread count (the kernels' block attention runs its GEMMs one per kernel thread).
void mlxtoy_blas_set_threads(int n) { set_threads(n); }
int mlxtoy_blas_threads() { return get_threads(); }

void cblas_sgemm(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  sgemm(layout, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int layout, int trans_a, int trans_b, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  dgemm(layout, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int layout, int trans_a, int trans_b, int m, int n, int k, const void* alpha, const void* a,
                 int lda, const void* b, int ldb, const void* beta, void* c, int ldc) {
  cgemm(layout, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // extern "C"
