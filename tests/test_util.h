// Helpers shared by the C++ tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "linattn/core/error.h"
#include "linattn/core/random.h"
#include "linattn/tensor.h"
#include "linattn/core/parallel.h"

namespace linattn::testing {

template <class T>
Tensor<T> random_tensor(const Shape& shape, uint64_t seed, double sigma = 1.0) {
  Tensor<T> t(shape);
  fill_normal(t.data(), t.size(), seed, sigma);
  return t;
}

template <class To, class From>
Tensor<To> cast(const Tensor<From>& x) {
  Tensor<To> y(x.shape());
  for (int64_t i = 0; i < x.size(); ++i) y[i] = static_cast<To>(x[i]);
  return y;
}

// The message of the linattn::Error that fn throws, or "<no error>".
template <class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// Sets the library's thread count for one scope.
class ScopedThreads {
 public:
  explicit ScopedThreads(int n) : saved_(num_threads()) { set_num_threads(n); }
  ~ScopedThreads() { set_num_threads(saved_); }

 private:
  int saved_;
};

// Unit roundoff u = eps/2 and γ_n = n·u / (1 − n·u) (Higham, Accuracy and Stability, §3.1).
template <class T>
constexpr double unit_roundoff() {
  return std::numeric_limits<T>::epsilon() / 2;
}
template <class T>
double gamma(double n) {
  const double nu = n * unit_roundoff<T>();
  return nu / (1 - nu);
}

// Every element of `got` within `bound` of `want` (same shapes); reports the worst offender.
template <class T>
void expect_within(const Tensor<T>& got, const Tensor<double>& want, const Tensor<double>& bound,
                   const char* what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.shape(), bound.shape()) << what;
  int64_t worst = -1;
  double worst_ratio = 0, max_err = 0;
  for (int64_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    max_err = std::max(max_err, err);
    const double ratio = err / bound[i];
    if (!(err <= bound[i]) && (worst < 0 || ratio > worst_ratio)) {
      worst = i;
      worst_ratio = ratio;
    }
  }
  if (std::getenv("LINATTN_TEST_VERBOSE")) {
    double max_ratio = 0;
    for (int64_t i = 0; i < got.size(); ++i)
      if (bound[i] > 0) max_ratio = std::max(max_ratio, std::abs(double(got[i]) - want[i]) / bound[i]);
    std::printf("  %s: max error %.3g, max error/bound %.3g\n", what, max_err, max_ratio);
  }
  EXPECT_LT(worst, 0) << what << ": element " << worst << " is " << got[worst] << ", expected "
                      << want[worst] << " within " << bound[worst] << " (error "
                      << std::abs(got[worst] - want[worst]) << ")";
}

// Central differences of a float64 forward's loss L = Σ out∘G against the analytic gradient
// of L with respect to every element of x. h = 1e-5: the truncation term h²/6·|L‴| and the
// cancellation term u·|L|/h are both ~1e-10 for O(1) inputs and derivatives; tolerance
// 1e-7·(1 + |g|) leaves a factor of 1000 for larger third derivatives.
template <class Fwd>
void expect_gradient(Tensor<double>& x, const Tensor<double>& analytic, Fwd loss, const char* name) {
  ASSERT_EQ(x.shape(), analytic.shape()) << name;
  const double h = 1e-5;
  for (int64_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss();
    x[i] = x0 - h;
    const double lm = loss();
    x[i] = x0;
    const double fd = (lp - lm) / (2 * h);
    ASSERT_NEAR(analytic[i], fd, 1e-7 * (1 + std::abs(fd))) << name << "[" << i << "]";
  }
}

// Σ out∘G, the scalar loss the gradient checks differentiate.
template <class T>
double dot_loss(const Tensor<T>& out, const Tensor<double>& G) {
  double L = 0;
  for (int64_t i = 0; i < out.size(); ++i) L += static_cast<double>(out[i]) * G[i];
  return L;
}

}  // namespace linattn::testing

