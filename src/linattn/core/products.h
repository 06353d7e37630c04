// Which arithmetic a float32 computation's matrix products use: the BLAS in float32, or
// operands rounded to bfloat16 and summed in float32 by vdpbf16ps (AVX512-BF16), about twice the
// float32 FMA rate. The kernelized methods' bfloat16 calls take the second (docs/precision.md).
#pragma once

#include <type_traits>

#include "linattn/core/blas.h"
#include "linattn/low_precision.h"
#include "linattn/memory.h"

namespace linattn {

enum class Products {
  Native,    // matmul<T>: the BLAS in the operands' own type
  Bfloat16,  // float32 only: A and B rounded to bfloat16 (nearest even), float32 sums
};

// Throws std::logic_error unless kind is Native (float64 products are always the BLAS's).
void require_native_products(Products kind);

// Whether this CPU runs Products::Bfloat16 (avx512_bf16::usable()).
bool bfloat16_products_usable();

// C = alpha·A·B + beta·C, matmul's contract (beta = 0: C is not read). Bfloat16: each product
// a_ik·b_kj of the rounded operands is exact in float32 and each pair of them is summed by two
// rounded fused multiply-adds; subnormal operands and results flush to zero. With alpha = 1
// and beta = 1 the sum starts from C; otherwise alpha and beta apply in float32 after it.
// Throws std::logic_error on a CPU without AVX512-BF16. Its operand copies are per thread,
// grown on first use and kept for the thread's life, outside the workspace count: the
// callers are pool workers that run many products of the same sizes (at most the engine's
// 1024-row block times its feature count: about 2 MiB at m' = 256).
void matmul_bf16(Mat<float> C, Mat<const float> A, Mat<const float> B, float alpha = 1, float beta = 0);

// matmul_bf16's B, rounded and packed once for many products with the same B: a FAVOR
// projection, which every causal chunk of 32 rows multiplies (packing ω per call took about 9%
// of FAVOR's causal bfloat16 forward, m = 256). matmul_bf16(C, A, packed) gives the bits of
// matmul_bf16(C, A, B). Throws std::logic_error on a CPU without AVX512-BF16.
class Bf16PackedB {
 public:
  Bf16PackedB() = default;  // empty: pack() before use
  explicit Bf16PackedB(Mat<const float> B) { pack(B); }
  // B packed here, in place of what was (the buffers grow to the largest B and are kept).
  void pack(Mat<const float> B);
  int64_t rows() const { return rows_; }  // B's K
  int64_t cols() const { return cols_; }  // B's N

 private:
  friend void matmul_bf16(Mat<float> C, Mat<const float> A, const Bf16PackedB& B, float alpha, float beta);
  int64_t rows_ = 0, cols_ = 0;
  bool thin_tail_ = false;
  Buffer<bfloat16> packed_, tail_;  // the 16-column blocks; a last block of <= 4 columns as columns
};
void matmul_bf16(Mat<float> C, Mat<const float> A, const Bf16PackedB& B, float alpha = 1, float beta = 0);

template <class T>
void matmul(Products kind, Mat<T> C, Mat<const T> A, Mat<const T> B, T alpha = T(1), T beta = T(0)) {
  if constexpr (std::is_same_v<T, float>) {
    if (kind == Products::Bfloat16) return matmul_bf16(C, A, B, alpha, beta);
  } else {
    require_native_products(kind);
  }
  matmul<T>(C, A, B, alpha, beta);
}

}  // namespace linattn
