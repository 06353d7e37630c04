// The rounding bound of Hedgehog's map φ = [softmax(u), softmax(−u)], u = x·W_h + b_h, computed
// in T (core/hedgehog_map.h; kernelized/hedgehog.cc), relative to each feature. Per row, with
// A = max_j (|b_j| + Σ_c |x_c W_cj|) and R = max_j u_j − min_j u_j:
//   - each logit is a (d + 1)-term sum: |Δu_j| <= γ_{d+1}·A;
//   - the shift u_j − M rounds once: a further |Δ| <= u·R;
//   a perturbation δ of the logits moves softmax_j by a relative |δ_j − Σ_k p_k δ_k| <= 2 max|δ|;
//   - exp within e_T (simd.cc's ExpNonPositive: 1.3 ulp in float32, 2.6u; Highway's 1 ulp in
//     float64, 2u), in the numerator and in each term of the sum: 2e_T;
//   - the f-term sum of positive terms γ_{f−1}, 1/sum and the product one rounding each: γ_{f+1}.
// So |φ̂_j − φ_j| <= ρ·φ_j, ρ = 2(γ_{d+1}A + uR) + 2e_T + γ_{f+1}, to first order; the bound takes
// 1.01ρ for the second-order terms (ρ < 1e-3 here).
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "linattn/tensor.h"
#include "test_util.h"

namespace linattn::testing {

// ρ of the row x [d] with W [d, f] (row-major) and b [f], in double.
template <class T>
double hedgehog_row_bound(const double* x, const double* W, const double* b, int64_t d, int64_t f) {
  const double u = std::ldexp(1.0, -std::numeric_limits<T>::digits);
  const double exp_err = std::is_same_v<T, float> ? 2.6 * u : 2 * u;
  double A = 0, hi = -INFINITY, lo = INFINITY;
  for (int64_t j = 0; j < f; ++j) {
    double a = std::abs(b[j]), logit = b[j];
    for (int64_t c = 0; c < d; ++c) {
      a += std::abs(x[c] * W[c * f + j]);
      logit += x[c] * W[c * f + j];
    }
    A = std::max(A, a);
    hi = std::max(hi, logit);
    lo = std::min(lo, logit);
  }
  const double rho = 2 * (gamma<T>(static_cast<double>(d + 1)) * A + u * (hi - lo)) + 2 * exp_err +
                     gamma<T>(static_cast<double>(f + 1));
  return 1.01 * rho;
}

// The largest ρ over every row of x [B, H, n, d] with its head's W [H, d, f] and b [H, f].
template <class T>
double hedgehog_bound(const Tensor<double>& x, const Tensor<double>& W, const Tensor<double>& b) {
  const int64_t H = x.dim(1), n = x.dim(2), d = x.dim(3), f = W.dim(2);
  double rho = 0;
  for (int64_t row = 0; row < x.size() / d; ++row) {
    const int64_t h = row / n % H;
    rho = std::max(rho, hedgehog_row_bound<T>(x.data() + row * d, W.data() + h * d * f, b.data() + h * f, d, f));
  }
  return rho;
}

}  // namespace linattn::testing
