// Random projections ω [m, d] for random-feature attention (Performer / FAVOR+).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "linattn/tensor.h"

namespace linattn {

enum class FeatureKind {
  IID,              // rows drawn from N(0, I_d)
  Orthogonal,       // blocks of d orthogonal directions, norms drawn from chi(d)
  OrthogonalFixed,  // same directions, every norm sqrt(d)
  Quantile,         // same directions, norms the chi(d) quantiles at i/(m+1), seeded order
};

FeatureKind parse_feature_kind(const std::string& kind);  // "iid", "orthogonal", ...
const char* feature_kind_name(FeatureKind kind);

// ω [num_features, head_dim]. Same seed, same matrix on every machine and thread count: it
// is computed in float64 by plain loops in a fixed order (a thin Householder QR of only the
// rows each block needs, O(d·r²); no BLAS/LAPACK, whose kernels are chosen per CPU and round
// differently), then rounded to T.
template <class T>
Tensor<T> random_features(int64_t num_features, int64_t head_dim,
                          FeatureKind kind = FeatureKind::Orthogonal, uint64_t seed = 0);

// The same with kind by name: "iid", "orthogonal", "orthogonal_fixed", "quantile".
template <class T>
Tensor<T> random_features(int64_t num_features, int64_t head_dim, const std::string& kind,
                          uint64_t seed = 0) {
  return random_features<T>(num_features, head_dim, parse_feature_kind(kind), seed);
}

// The radii of FeatureKind::Quantile before shuffling: R_i with P(r <= R_i) = i/(m+1) for r
// chi-distributed with d degrees of freedom (R_i² is the chi-square(d) quantile), i = 1..m.
std::vector<double> chi_quantile_radii(int64_t num_features, int64_t head_dim);

// P(r <= x) for r ~ chi(d): the regularized lower incomplete gamma P(d/2, x²/2).
double chi_cdf(double x, int64_t d);

}  // namespace linattn
