#include "linattn/core/products.h"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "linattn/core/avx512_bf16.h"
#include "linattn/memory.h"

namespace linattn {
namespace {

// One worker's operand copies: A narrowed, B packed, B's thin last block as columns, and the
// float32 result when it cannot go straight into C.
struct Workspace {
  Buffer<bfloat16> a, b, tail;
  Buffer<float> c;
};

template <class T>
T* at_least(Buffer<T>& buf, int64_t count) {
  if (buf.size() < count) buf = Buffer<T>(count, false, Init::Uninitialized);
  return buf.data();
}

}  // namespace

void require_native_products(Products kind) {
  if (kind != Products::Native) throw std::logic_error("matmul: bfloat16 products are for float32 operands only");
}

bool bfloat16_products_usable() { return avx512_bf16::usable(); }

void matmul_bf16(Mat<float> C, Mat<const float> A, Mat<const float> B, float alpha, float beta) {
  if (!avx512_bf16::usable())
    throw std::logic_error("matmul_bf16: " + avx512_bf16::unavailable_reason() + " (bfloat16_products_usable() is false)");
  check_product_shapes("matmul_bf16", C, A, B);
  const int64_t M = C.rows, N = C.cols, K = A.op_cols();
  if (M == 0 || N == 0) return;
  if (K == 0) return matmul<float>(C, A, B, alpha, beta);  // beta·C, which the BLAS path leaves
  // A narrowed to rows of pairs and B packed (both through 16×16 transposes when transposed),
  // then dot() straight into C (alpha applied there after the sum), or, with beta ≠ 0 and a
  // scaled product, into a float32 result that alpha and beta then apply to.
  const int64_t pairs = (K + 1) / 2, blocks = (N + 15) / 16;
  thread_local Workspace ws;
  bfloat16* an = at_least(ws.a, M * 2 * pairs);
  bfloat16* bp = at_least(ws.b, avx512_bf16::packed_size(K, N));
  avx512_bf16::narrow_matrix(A.data, A.ld, M, K, A.transposed, an, 2 * pairs);
  avx512_bf16::pack_matrix(B.data, B.ld, K, N, B.transposed, bp);
  const avx512_bf16::PackedB packed{bp, 512, blocks * 512};
  // A last block of at most four columns goes to dot_columns, from its columns' pairs copied out
  // of the packed block (so the rounding is the same).
  const int64_t last = N - 16 * (blocks - 1);
  const bool thin_tail = last <= 4;
  const int64_t full = thin_tail ? blocks - 1 : blocks, tail_ld = 2 * pairs;
  bfloat16* tail = thin_tail ? at_least(ws.tail, last * tail_ld) : nullptr;
  if (thin_tail) {
    uint32_t word;
    for (int64_t j = 0; j < last; ++j)
      for (int64_t p = 0; p < pairs; ++p) {
        std::memcpy(&word, bp + (p / 16) * blocks * 512 + (p % 16) * 32 + full * 512 + 2 * j, sizeof word);
        std::memcpy(tail + j * tail_ld + 2 * p, &word, sizeof word);
      }
  }
  auto product = [&](float* c, int64_t ldc, bool accumulate) {
    if (full > 0) avx512_bf16::dot(an, 2 * pairs, M, packed, pairs, full, c, ldc, accumulate, thin_tail ? 16 : last);
    if (thin_tail)
      avx512_bf16::dot_columns(an, 2 * pairs, M, tail, tail_ld, pairs, last, c + 16 * full, ldc, accumulate);
  };
  if (beta == 0 || (alpha == 1 && beta == 1)) {
    product(C.data, C.ld, beta == 1);
    if (alpha != 1)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) C.data[i * C.ld + j] *= alpha;
    return;
  }
  float* r = at_least(ws.c, M * N);
  product(r, N, false);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C.data[i * C.ld + j] = alpha * r[i * N + j] + beta * C.data[i * C.ld + j];
}

}  // namespace linattn
