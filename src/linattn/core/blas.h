// Matrix products and the one LAPACK routine we use, through the BLAS we link (OpenBLAS, see
// docs/design.md). Row-major, float and double.
#pragma once

#include <cstdint>

namespace linattn {

enum class Trans { No, Yes };

// C[M×N] = alpha · op(A)[M×K] · op(B)[K×N] + beta · C, all row-major with leading dims.
template <class T>
void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
          const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

const char* blas_name();

// The singular value decomposition of a column-major n×n matrix a (overwritten) by LAPACK's
// dgesdd: a = u·diag(s)·vt, s descending; with u and vt null, the values only. `fn` names the
// caller in errors.
void svd(const char* fn, int64_t n, double* a, double* s, double* u = nullptr, double* vt = nullptr);  // e.g. "OpenBLAS 0.3.21 ... (core Haswell)"

// The BLAS runs single-threaded, always: parallelism comes from our own loops, and a BLAS that
// spawned threads inside each of our workers would oversubscribe the machine. Set once, on the
// first product, and never changed again (so concurrent callers cannot race on it).

}  // namespace linattn
