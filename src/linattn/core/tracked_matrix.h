// Plain float64 matrices for the methods' reference implementations (the reference library).
// Each carries, beside its value, a worst-case bound on the absolute rounding error
// that a fast path commits computing the same expression in a precision of unit roundoff u:
// first-order running bounds in the style of Higham (Accuracy and Stability of Numerical
// Algorithms, ch. 3), every error aligned, γ_n = n·u/(1 − n·u). With u = 0 the bounds are 0
// and these are just straightforward float64 loops. The fast paths must evaluate the same
// expressions in the same association; each operation below says what it assumes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "linattn/core/bounded.h"

namespace linattn::reference {

struct Arith {
  double u = 0;  // unit roundoff of the fast path being bounded; 0 for a plain reference
  double gamma(double n) const { return n * u / (1 - n * u); }
};

struct Tracked {
  int64_t rows = 0, cols = 0;
  std::vector<double> val, err;

  Tracked() = default;
  Tracked(int64_t r, int64_t c)
      : rows(r), cols(c), val(static_cast<size_t>(r * c)), err(static_cast<size_t>(r * c)) {}
  double& v(int64_t i, int64_t j) { return val[static_cast<size_t>(i * cols + j)]; }
  double v(int64_t i, int64_t j) const { return val[static_cast<size_t>(i * cols + j)]; }
  double& e(int64_t i, int64_t j) { return err[static_cast<size_t>(i * cols + j)]; }
  double e(int64_t i, int64_t j) const { return err[static_cast<size_t>(i * cols + j)]; }
};

// A result of `shape` with value and bound 0, for references to fill with store().
Bounded zero_bounded(const Shape& shape);
// Writes x's values and bounds into r from flat offset on, its rows ld apart.
void store(const Tracked& x, Bounded& r, int64_t offset, int64_t ld);
// Writes x as the first rows of head bh of a [B, H, n, c] result.
void store_head(const Tracked& x, Bounded& r, int64_t bh);

// rows × cols values of an input (exact: error 0), row i at data + i·ld.
Tracked input(const double* data, int64_t rows, int64_t cols, int64_t ld);
Tracked transpose(const Tracked& x);

// alpha·op(A)·op(B) as one BLAS product: |δC| ≤ |α|(γ_{K+2}|A||B| + |δA||B| + |A||δB| + |δA||δB|)
// (the +2 covers rounding α to the fast path's type and applying it).
Tracked matmul(const Arith& a, const Tracked& A, bool trans_a, const Tracked& B, bool trans_b,
               double alpha = 1);
// A + c·B elementwise: |δ| ≤ |δA| + |c||δB| + 2u(|A| + |c·B|).
Tracked add(const Arith& a, const Tracked& A, const Tracked& B, double c = 1);
// c·X: |δ| ≤ |c||δX| + 2u|c·X|.
Tracked scale(const Arith& a, const Tracked& X, double c);
// c·I − X for square X: |δ| ≤ |δX| + u|c·I − X|.
Tracked identity_minus(const Arith& a, double c, const Tracked& X);

// P = softmax of each row of S, computed as exp(s − max) (exp within 1 ulp), a sum, and a
// multiplication by 1/sum. With δs the row's largest score error, each exp is off by a
// relative ε_j ≤ expm1(2δs + u|s_j − max|) + 2u, so |δP_j| ≤ (2·max_j ε_j + γ_{cols+3})·P_j.
// The bound also covers a fast path that keeps exp(s − max) unnormalised and applies 1/sum to a
// later product instead (a method that normalises after its next product): each term carries
// relative error ≤ ε_j + γ_{cols+1} in place of the above, and the product's own rounding of
// the 1/sum factor is the one its matmul bound (γ_{K+2}) already allows for α.
Tracked softmax_rows(const Arith& a, const Tracked& S);
// dS = P ∘ (dP − δ), δ = Σ_j P_j dP_j per row (a dot product, then one subtraction and one
// product per element).
Tracked softmax_rows_backward(const Arith& a, const Tracked& P, const Tracked& dP);

// A⁻¹ by Gauss–Jordan elimination with partial pivoting, bounding a fast path that inverts by
// SVD in float64 and rounds the result to its own type: first-order perturbation
// |δZ| ≤ |Z||δA||Z| / (1 − ‖|Z||δA|‖∞), plus the SVD's own error, taken as backward error
// m²·u₆₄‖A‖_F (a generous p(m) for LAPACK's gesdd) and m^{3/2}·u₆₄‖Z‖_F for forming V Σ⁻¹ Uᵀ,
// plus u|Z| for the final rounding. Throws linattn::Error when A is singular to working precision
// or the perturbation bound does not apply (‖|Z||δA|‖∞ >= 1).
Tracked inverse(const Arith& a, const Tracked& A);

}  // namespace linattn::reference
