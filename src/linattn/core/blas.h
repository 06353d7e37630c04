// Matrix products through the BLAS we link (OpenBLAS). Row-major, float and double.
#pragma once

#include <cstdint>

namespace linattn {

enum class Trans { No, Yes };

// C[M×N] = alpha · op(A)[M×K] · op(B)[K×N] + beta · C, all row-major with leading dims.
template <class T>
void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
          const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// Threads the BLAS itself uses for one large product (for the GEMM-rate benchmark).
int blas_num_threads();
void set_blas_num_threads(int n);
const char* blas_name();  // e.g. "OpenBLAS 0.3.21 ... (core SkylakeX)"

// OpenBLAS picks its kernels by CPU model, and 0.3.21 does not know CPUs newer than it
// (Sapphire Rapids runs its AVX2 "Haswell" kernels). Returns the OPENBLAS_CORETYPE value that
// would select the kernels this CPU supports, or nullptr when the current choice is right.
// The variable is read when OpenBLAS loads, so only a new process can use it.
const char* better_blas_coretype();

// While alive, BLAS calls are single-threaded; restores the previous count on exit.
// parallel_for holds one, so two of our workers never fight over the BLAS's own threads.
class BlasSingleThreaded {
 public:
  BlasSingleThreaded();
  ~BlasSingleThreaded();
  BlasSingleThreaded(const BlasSingleThreaded&) = delete;
  BlasSingleThreaded& operator=(const BlasSingleThreaded&) = delete;

 private:
  int saved_;
};

}  // namespace linattn
