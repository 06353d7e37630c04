#include "linattn/core/products.h"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "linattn/core/avx512_bf16.h"
#include "linattn/core/simd.h"
#include "linattn/memory.h"

namespace linattn {
namespace {

// One worker's operand copies: A narrowed, B packed, B's thin last block as columns, and the
// float32 result when it cannot go straight into C.
struct Workspace {
  Buffer<bfloat16> a, b, tail;
  Buffer<float> c;
};

// The calling thread's (both forms of matmul_bf16 share it).
Workspace& thread_workspace() {
  thread_local Workspace ws;
  return ws;
}

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

namespace {

// B [K×N] packed as dot()'s operand (pack_matrix), with a last block of at most four columns
// copied out of it as columns for dot_columns (so the rounding is the same): into bp
// (packed_size(K, N) values) and tail (grown to last·2·pairs values). Returns whether there is
// such a thin tail.
bool pack_operand(Mat<const float> B, bfloat16* bp, Buffer<bfloat16>& tail_buffer) {
  const int64_t K = B.op_rows(), N = B.op_cols(), pairs = (K + 1) / 2, blocks = (N + 15) / 16;
  avx512_bf16::pack_matrix(B.data, B.ld, K, N, B.transposed, bp);
  const int64_t last = N - 16 * (blocks - 1);
  if (last > 4) return false;
  const int64_t full = blocks - 1, tail_ld = 2 * pairs;
  bfloat16* tail = at_least(tail_buffer, last * tail_ld);
  uint32_t word;
  for (int64_t j = 0; j < last; ++j)
    for (int64_t p = 0; p < pairs; ++p) {
      std::memcpy(&word, bp + (p / 16) * blocks * 512 + (p % 16) * 32 + full * 512 + 2 * j, sizeof word);
      std::memcpy(tail + j * tail_ld + 2 * p, &word, sizeof word);
    }
  return true;
}

// C = alpha·A·B + beta·C with B packed by pack_operand (K×N; tail null when it has no thin tail).
void product_packed(Mat<float> C, Mat<const float> A, const bfloat16* bp, const bfloat16* tail, int64_t K, int64_t N,
                    float alpha, float beta, Workspace& ws) {
  const int64_t M = C.rows;
  // A narrowed to rows of pairs (through 16×16 transposes when transposed), then dot() straight
  // into C (alpha applied there after the sum), or, with beta ≠ 0 and a scaled product, into a
  // float32 result that alpha and beta then apply to.
  const int64_t pairs = (K + 1) / 2, blocks = (N + 15) / 16;
  bfloat16* an = at_least(ws.a, M * 2 * pairs);
  avx512_bf16::narrow_matrix(A.data, A.ld, M, K, A.transposed, an, 2 * pairs);
  const avx512_bf16::PackedB packed{bp, 512, blocks * 512};
  const int64_t last = N - 16 * (blocks - 1);
  const bool thin_tail = tail != nullptr;
  const int64_t full = thin_tail ? blocks - 1 : blocks, tail_ld = 2 * pairs;
  auto product = [&](float* c, int64_t ldc, bool accumulate) {
    if (full > 0) avx512_bf16::dot(an, 2 * pairs, M, packed, pairs, full, c, ldc, accumulate, thin_tail ? 16 : last);
    if (thin_tail)
      avx512_bf16::dot_columns(an, 2 * pairs, M, tail, tail_ld, pairs, last, c + 16 * full, ldc, accumulate);
  };
  if (beta == 0 || (alpha == 1 && beta == 1)) {
    product(C.data, C.ld, beta == 1);
    if (alpha != 1)
      for (int64_t i = 0; i < M; ++i) simd::scale(C.data + i * C.ld, static_cast<size_t>(N), alpha);
    return;
  }
  float* r = at_least(ws.c, M * N);
  product(r, N, false);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C.data[i * C.ld + j] = alpha * r[i * N + j] + beta * C.data[i * C.ld + j];
}

void require_usable(const char* fn) {
  if (!avx512_bf16::usable())
    throw std::logic_error(std::string(fn) + ": " + avx512_bf16::unavailable_reason() +
                           " (bfloat16_products_usable() is false)");
}

}  // namespace

void matmul_bf16(Mat<float> C, Mat<const float> A, Mat<const float> B, float alpha, float beta) {
  require_usable("matmul_bf16");
  check_product_shapes("matmul_bf16", C, A, B);
  const int64_t K = A.op_cols(), N = C.cols;
  if (C.rows == 0 || N == 0) return;
  if (K == 0) return matmul<float>(C, A, B, alpha, beta);  // beta·C, which the BLAS path leaves
  Workspace& ws = thread_workspace();
  bfloat16* bp = at_least(ws.b, avx512_bf16::packed_size(K, N));
  const bool thin = pack_operand(B, bp, ws.tail);
  product_packed(C, A, bp, thin ? ws.tail.data() : nullptr, K, N, alpha, beta, ws);
}

void Bf16PackedB::pack(Mat<const float> B) {
  require_usable("Bf16PackedB");
  rows_ = B.op_rows(), cols_ = B.op_cols(), thin_tail_ = false;
  if (rows_ == 0 || cols_ == 0) return;
  thin_tail_ = pack_operand(B, at_least(packed_, avx512_bf16::packed_size(rows_, cols_)), tail_);
}

void matmul_bf16(Mat<float> C, Mat<const float> A, const Bf16PackedB& B, float alpha, float beta) {
  require_usable("matmul_bf16");
  // The shapes against a stand-in for B (its data is not read).
  check_product_shapes("matmul_bf16", C, A, Mat<const float>{A.data, B.rows(), B.cols(), B.cols(), false});
  const int64_t K = B.rows(), N = B.cols();
  if (C.rows == 0 || N == 0) return;
  if (K == 0) {  // beta·C, as the unpacked call leaves it
    for (int64_t i = 0; i < C.rows; ++i)
      for (int64_t j = 0; j < N; ++j) C.data[i * C.ld + j] = beta == 0 ? 0.0f : beta * C.data[i * C.ld + j];
    return;
  }
  product_packed(C, A, B.packed_.data(), B.thin_tail_ ? B.tail_.data() : nullptr, K, N, alpha, beta,
                 thread_workspace());
}

}  // namespace linattn
