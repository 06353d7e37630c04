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
  cblas_dgemm(CblasRowMajor, to_cblas(ta), to_cblas(tb), to_int(M, "M"), to_int(N, "N"),
              to_int(K, "K"), alpha, A, to_int(lda, "lda"), B, to_int(ldb, "ldb"), beta, C,
              to_int(ldc, "ldc"));
}

int blas_num_threads() { return openblas_get_num_threads(); }
void set_blas_num_threads(int n) {
  require(n >= 1, "set_blas_num_threads: n must be >= 1, got ", n);
  openblas_set_num_threads(n);
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

const char* better_blas_coretype() {
  const std::string core = openblas_get_corename();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (avx512 && (core == "Haswell" || core == "Zen" || core == "Sandybridge")) return "SkylakeX";
  return nullptr;
}

BlasSingleThreaded::BlasSingleThreaded() : saved_(openblas_get_num_threads()) {
  if (saved_ != 1) openblas_set_num_threads(1);
}
BlasSingleThreaded::~BlasSingleThreaded() {
  if (saved_ != 1) openblas_set_num_threads(saved_);
}

}  // namespace linattn
