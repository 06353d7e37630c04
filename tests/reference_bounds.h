// Comparing a fast path with a tracked reference (src/linattn/core/tracked_matrix.h).
#pragma once

#include "linattn/core/bounded.h"
#include "test_util.h"

namespace linattn::testing {

// got (arithmetic in T) within the reference's bound for T plus its bound for float64 (the
// reference's own rounding) of the reference value.
template <class T>
void expect_matches(const Tensor<T>& got, const reference::Bounded& at_t,
                    const reference::Bounded& at_f64, const char* what) {
  Tensor<double> bound(at_t.bound.shape());
  for (int64_t i = 0; i < bound.size(); ++i) bound[i] = at_t.bound[i] + at_f64.bound[i];
  expect_within(got, at_t.value, bound, what);
}

// Asks the bounds to say something: the largest bound is below `fraction` of the largest |value|.
inline void expect_informative(const reference::Bounded& r, double fraction, const char* what) {
  double vmax = 0, bmax = 0;
  for (int64_t i = 0; i < r.value.size(); ++i) {
    vmax = std::max(vmax, std::abs(r.value[i]));
    bmax = std::max(bmax, r.bound[i]);
  }
  EXPECT_LE(bmax, fraction * vmax) << what << ": the derived bound is too loose to test anything";
}

// Inputs with the structure of a trained model's: n positions in `clusters` contiguous runs that
// share a direction (scale `spread`, drawn from `centre_seed`, so queries and keys built from the
// same centres match each other), plus unit noise from `seed`. Used where random Gaussian inputs
// make the landmark kernel near-singular (means of random vectors shrink towards 0).
inline Tensor<double> clustered(const Shape& shape, int64_t clusters, double spread, uint64_t seed,
                                uint64_t centre_seed = 1000) {
  Tensor<double> x = random_tensor<double>(shape, seed);
  const int64_t n = shape[2], d = shape[3], rows = shape[0] * shape[1];
  const Tensor<double> centres = random_tensor<double>({rows, clusters, d}, centre_seed, spread);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = i * clusters / n;
      for (int64_t j = 0; j < d; ++j) x[(r * n + i) * d + j] += centres[(r * clusters + c) * d + j];
    }
  return x;
}

}  // namespace linattn::testing
