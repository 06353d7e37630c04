// Softmax along the rows of a row-major block, and its backward, on the SIMD layer. Used by the
// methods that softmax small score blocks they hold whole.
#pragma once

#include <cmath>
#include <cstdint>

#include "linattn/core/error.h"
#include "linattn/core/simd.h"

namespace linattn {

// x[r, 0..cols) = softmax(x[r, 0..cols)) for each of `rows` rows of leading dimension ld.
// With inv_sums, the rows are left as exp(x − max) and inv_sums[r] = 1/sum: the caller divides
// a later product instead (fewer operations, and no more rounding per term than dividing
// first). A row of no columns stays empty. `fn` names the caller if scores overflowed.
template <class T>
void softmax_rows(const char* fn, T* x, int64_t rows, int64_t cols, int64_t ld, T* inv_sums = nullptr) {
  if (cols == 0 || rows == 0) return;
  require(simd::softmax_rows(x, static_cast<size_t>(rows), static_cast<size_t>(cols),
                             static_cast<size_t>(ld), inv_sums),
          fn, ": attention scores overflowed to inf or NaN; the inputs are too large for this dtype");
}

// Undoes P = softmax(S) row by row: g holds dP on entry and dS = P ∘ (dP − rowsum(P ∘ dP)) on exit.
template <class T>
void softmax_rows_backward(const T* p, T* g, int64_t rows, int64_t cols, int64_t ld_p, int64_t ld_g) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* pr = p + r * ld_p;
    T* gr = g + r * ld_g;
    const T delta = simd::dot(pr, gr, static_cast<size_t>(cols));
    simd::softmax_grad(gr, pr, gr, static_cast<size_t>(cols), delta);
  }
}

}  // namespace linattn
