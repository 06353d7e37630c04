#include "linattn/core/blas.h"

#include <cblas.h>

#include <algorithm>
#include <stdexcept>
#include <limits>
#include <string>
#include <vector>

#include "linattn/core/error.h"

// SciPy's OpenBLAS build prefixes every symbol (scipy_cblas_sgemm, ...); its pkg-config file
// defines BLAS_SYMBOL_PREFIX. Unprefixed for a system OpenBLAS.
#ifdef BLAS_SYMBOL_PREFIX
#define LINATTN_CONCAT2(a, b) a##b
#define LINATTN_CONCAT(a, b) LINATTN_CONCAT2(a, b)
#define BLAS_FN(name) LINATTN_CONCAT(BLAS_SYMBOL_PREFIX, name)
#else
#define BLAS_FN(name) name
#endif

extern "C" void BLAS_FN(dgesdd_)(const char* jobz, const int* m, const int* n, double* a, const int* lda,
                                 double* s, double* u, const int* ldu, double* vt, const int* ldvt,
                                 double* work, const int* lwork, int* iwork, int* info);

namespace linattn {
namespace {
enum class Trans { No, Yes };
CBLAS_TRANSPOSE to_cblas(Trans t) { return t == Trans::Yes ? CblasTrans : CblasNoTrans; }
blasint to_int(int64_t v, const char* what) {
  require(v >= 0 && v <= std::numeric_limits<blasint>::max(), "gemm: ", what, " = ", v,
          " is outside the BLAS integer range");
  return static_cast<blasint>(v);
}
// Called before every product; sets the BLAS to one thread the first time.
void single_threaded_blas() {
  static const bool once = [] {
    BLAS_FN(openblas_set_num_threads)(1);
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
void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha,
                 const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                 int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_rows(M, N, beta, C, ldc);
  single_threaded_blas();
  BLAS_FN(cblas_sgemm)(CblasRowMajor, to_cblas(ta), to_cblas(tb), to_int(M, "M"), to_int(N, "N"),
              to_int(K, "K"), alpha, A, to_int(lda, "lda"), B, to_int(ldb, "ldb"), beta, C,
              to_int(ldc, "ldc"));
}

void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, double alpha,
                  const double* A, int64_t lda, const double* B, int64_t ldb, double beta,
                  double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_rows(M, N, beta, C, ldc);
  single_threaded_blas();
  BLAS_FN(cblas_dgemm)(CblasRowMajor, to_cblas(ta), to_cblas(tb), to_int(M, "M"), to_int(N, "N"),
              to_int(K, "K"), alpha, A, to_int(lda, "lda"), B, to_int(ldb, "ldb"), beta, C,
              to_int(ldc, "ldc"));
}

}  // namespace

template <class T>
void check_product_shapes(const char* fn, Mat<T> C, Mat<const T> A, Mat<const T> B) {
  auto bad = [&](const char* what) {
    throw std::logic_error(std::string(fn) + ": " + what + ": C " + std::to_string(C.rows) + "x" +
                           std::to_string(C.cols) + ", A " + std::to_string(A.op_rows()) + "x" +
                           std::to_string(A.op_cols()) + ", B " + std::to_string(B.op_rows()) + "x" +
                           std::to_string(B.op_cols()));
  };
  if (C.transposed) bad("the result cannot be a transpose");
  if (A.op_rows() != C.rows || B.op_cols() != C.cols || A.op_cols() != B.op_rows()) bad("shapes do not agree");
  for (const auto* m : {&A, &B})
    if (m->rows > 0 && m->cols > 0 && m->ld < m->cols) bad("a leading dimension is shorter than its rows");
  if (C.rows > 0 && C.cols > 0 && C.ld < C.cols) bad("C's leading dimension is shorter than its rows");
}

template void check_product_shapes<float>(const char*, Mat<float>, Mat<const float>, Mat<const float>);
template void check_product_shapes<double>(const char*, Mat<double>, Mat<const double>, Mat<const double>);

template <class T>
void matmul(Mat<T> C, Mat<const T> A, Mat<const T> B, T alpha, T beta) {
  check_product_shapes("matmul", C, A, B);
  gemm(A.transposed ? Trans::Yes : Trans::No, B.transposed ? Trans::Yes : Trans::No, C.rows, C.cols,
       A.op_cols(), alpha, A.data, A.ld, B.data, B.ld, beta, C.data, C.ld);
}

template void matmul<float>(Mat<float>, Mat<const float>, Mat<const float>, float, float);
template void matmul<double>(Mat<double>, Mat<const double>, Mat<const double>, double, double);

template <class T>
void solve_unit_lower(Mat<const T> A, Mat<T> B) {
  if (A.rows != A.cols || A.rows != B.rows || B.transposed || (A.rows > 0 && A.ld < A.cols) ||
      (B.rows > 0 && B.cols > 0 && B.ld < B.cols))
    throw std::logic_error("solve_unit_lower: A " + std::to_string(A.rows) + "x" + std::to_string(A.cols) + ", B " +
                           std::to_string(B.rows) + "x" + std::to_string(B.cols));
  if (B.rows == 0 || B.cols == 0) return;
  single_threaded_blas();
  const CBLAS_TRANSPOSE t = A.transposed ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>)
    BLAS_FN(cblas_strsm)(CblasRowMajor, CblasLeft, CblasLower, t, CblasUnit, to_int(B.rows, "M"), to_int(B.cols, "N"),
                         1.0f, A.data, to_int(A.ld, "lda"), B.data, to_int(B.ld, "ldb"));
  else
    BLAS_FN(cblas_dtrsm)(CblasRowMajor, CblasLeft, CblasLower, t, CblasUnit, to_int(B.rows, "M"), to_int(B.cols, "N"),
                         1.0, A.data, to_int(A.ld, "lda"), B.data, to_int(B.ld, "ldb"));
}

template void solve_unit_lower<float>(Mat<const float>, Mat<float>);
template void solve_unit_lower<double>(Mat<const double>, Mat<double>);

const char* blas_name() {
  static const std::string name = [] {
    std::string s = BLAS_FN(openblas_get_config)();
    s += " (core ";
    s += BLAS_FN(openblas_get_corename)();
    s += ")";
    return s;
  }();
  return name.c_str();
}

void svd(const char* fn, int64_t n, double* a, double* s, double* u, double* vt) {
  require(n >= 1 && n <= std::numeric_limits<int>::max() / 8, fn, ": svd of a ", n, "×", n,
          " matrix is outside LAPACK's integer range");
  single_threaded_blas();
  const int ni = static_cast<int>(n);
  std::vector<int> iwork(static_cast<size_t>(8 * n));
  int lwork = -1, info = 0;
  double query = 0;
  const char* jobz = u && vt ? "A" : "N";
  BLAS_FN(dgesdd_)(jobz, &ni, &ni, a, &ni, s, u, &ni, vt, &ni, &query, &lwork, iwork.data(), &info);
  lwork = std::max(static_cast<int>(query), 1);
  std::vector<double> work(static_cast<size_t>(lwork));
  BLAS_FN(dgesdd_)(jobz, &ni, &ni, a, &ni, s, u, &ni, vt, &ni, work.data(), &lwork, iwork.data(), &info);
  require(info == 0, fn, ": LAPACK dgesdd failed (info = ", info, ")");
}

}  // namespace linattn
