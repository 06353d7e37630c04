#include "linattn/core/blas.h"

#include <cblas.h>

#include <limits>
#include <string>

#include "linattn/core/error.h"

namespace linattn {
namespace {
CBLAS_TRANSPOSE to_cblas(Trans t) { return t == Trans::Yes ? CblasTrans : CblasNoTrans; }
blasint to_int(int64_t v, const char* what) {
  require(v >= 0 && v <= std::numeric_limits<blasint>::max(), "gemm: ", what, " = ", v,
          " is outside the BLAS integer range");
  return static_cast<blasint>(v);
}
// Called before every product; sets the BLAS to one thread the first time.
void single_threaded_blas() {
  static const bool once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}
// C := beta·C, what a product with K = 0 leaves (the BLAS would reject lda = 0).
template <class T>
void scale_rows(int64_t M, int64_t N, T beta, T* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
}
}  // namespace

template <>
void gemm<float>(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha,
                 const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                 int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_rows(M, N, beta, C, ldc);
  single_threaded_blas();
  cblas_sgemm(CblasRowMajor, to_cblas(ta), to_cblas(tb), to_int(M, "M"), to_int(N, "N"),
              to_int(K, "K"), alpha, A, to_int(lda, "lda"), B, to_int(ldb, "ldb"), beta, C,
              to_int(ldc, "ldc"));
}

template <>
void gemm<double>(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, double alpha,
                  const double* A, int64_t lda, const double* B, int64_t ldb, double beta,
                  double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_rows(M, N, beta, C, ldc);
  single_threaded_blas();
  cblas_dgemm(CblasRowMajor, to_cblas(ta), to_cblas(tb), to_int(M, "M"), to_int(N, "N"),
              to_int(K, "K"), alpha, A, to_int(lda, "lda"), B, to_int(ldb, "ldb"), beta, C,
              to_int(ldc, "ldc"));
}

const char* blas_name() {
  static const std::string name = [] {
    std::string s = openblas_get_config();
    s += " (core ";
    s += openblas_get_corename();
    s += ")";
    return s;
  }();
  return name.c_str();
}

}  // namespace linattn
