// Matrix products and the one LAPACK routine we use, through the BLAS we link (OpenBLAS, see
// docs/design.md). Row-major, float and double.
#pragma once

#include <cstdint>
#include <type_traits>

namespace linattn {

// A row-major matrix operand: `rows`×`cols` values at `data`, consecutive rows `ld` apart
// (ld >= cols), or with `transposed` its transpose (then an operand of cols×rows). Made with
// mat(); .t() gives the transpose.
template <class T>
struct Mat {
  T* data;
  int64_t rows, cols, ld;
  bool transposed = false;
  Mat t() const { return {data, rows, cols, ld, !transposed}; }
  int64_t op_rows() const { return transposed ? cols : rows; }  // as an operand of a product
  int64_t op_cols() const { return transposed ? rows : cols; }
  operator Mat<const T>() const { return {data, rows, cols, ld, transposed}; }
};
template <class T>
Mat<T> mat(T* data, int64_t rows, int64_t cols, int64_t ld) {
  return {data, rows, cols, ld, false};
}
template <class T>
Mat<T> mat(T* data, int64_t rows, int64_t cols) {
  return {data, rows, cols, cols, false};
}

// C = alpha·A·B + beta·C for matrices C [M×N] (not transposed), A [M×K] and B [K×N] as
// operands (each possibly a transpose). The shapes must agree and every leading dimension must
// hold its rows; a mismatch is a bug of the caller (std::logic_error naming the sizes). An
// empty inner dimension leaves beta·C.
template <class T>
void matmul(Mat<T> C, Mat<const T> A, Mat<const T> B, T alpha = T(1), T beta = T(0));

// The checks of matmul's contract above, for other products that keep it (matmul_bf16); the
// std::logic_error names fn.
template <class T>
void check_product_shapes(const char* fn, Mat<T> C, Mat<const T> A, Mat<const T> B);

// B := op(A)⁻¹·B (BLAS trsm) for A [M×M] unit lower triangular: its strictly lower part is read,
// its diagonal taken as 1 and never read; op(A) = A, or Aᵀ when A is given as A.t(). B [M×N].
template <class T>
void solve_unit_lower(Mat<const T> A, Mat<T> B);

const char* blas_name();

// The singular value decomposition of a column-major n×n matrix a (overwritten) by LAPACK's
// dgesdd: a = u·diag(s)·vt, s descending; with u and vt null, the values only. `fn` names the
// caller in errors.
void svd(const char* fn, int64_t n, double* a, double* s, double* u = nullptr, double* vt = nullptr);  // e.g. "OpenBLAS 0.3.21 ... (core Haswell)"

// The BLAS runs single-threaded, always: parallelism comes from our own loops, and a BLAS that
// spawned threads inside each of our workers would oversubscribe the machine. Set once, on the
// first product, and never changed again (so concurrent callers cannot race on it).

}  // namespace linattn
