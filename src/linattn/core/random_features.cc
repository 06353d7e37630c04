#include "linattn/core/random_features.h"

#include <boost/math/special_functions/gamma.hpp>
#include <cmath>
#include <numeric>
#include <vector>

#include "linattn/core/random.h"

namespace linattn {
namespace {

// Q of the QR factorisation of a d×d matrix (row-major), by Householder reflections, with
// the sign of each column fixed so that R has a positive diagonal: then Q is Haar-distributed
// when the input is Gaussian (Mezzadri 2007). Returns Q row-major.
std::vector<double> haar_orthogonal(std::vector<double> a, int64_t d) {
  std::vector<double> q(static_cast<size_t>(d * d), 0.0), v(static_cast<size_t>(d));
  std::vector<double> sign(static_cast<size_t>(d), 1.0);
  std::vector<std::vector<double>> reflectors;
  for (int64_t k = 0; k < d; ++k) {
    double norm = 0;
    for (int64_t i = k; i < d; ++i) norm += a[i * d + k] * a[i * d + k];
    norm = std::sqrt(norm);
    const double alpha = a[k * d + k] > 0 ? -norm : norm;  // R_kk = alpha
    sign[k] = alpha > 0 ? 1.0 : -1.0;
    std::fill(v.begin(), v.end(), 0.0);
    for (int64_t i = k; i < d; ++i) v[i] = a[i * d + k];
    v[k] -= alpha;
    double vnorm2 = 0;
    for (int64_t i = k; i < d; ++i) vnorm2 += v[i] * v[i];
    if (vnorm2 > 0) {
      for (int64_t j = k; j < d; ++j) {  // A := (I − 2vvᵀ/vᵀv) A
        double dot = 0;
        for (int64_t i = k; i < d; ++i) dot += v[i] * a[i * d + j];
        const double f = 2 * dot / vnorm2;
        for (int64_t i = k; i < d; ++i) a[i * d + j] -= f * v[i];
      }
      for (int64_t i = k; i < d; ++i) v[i] /= std::sqrt(vnorm2);
    }
    reflectors.push_back(v);
  }
  // Q = H_0 H_1 … H_{d−1}, applied to the identity from the right-most reflector.
  for (int64_t i = 0; i < d; ++i) q[i * d + i] = 1;
  for (int64_t k = d - 1; k >= 0; --k) {
    const auto& u = reflectors[k];
    for (int64_t j = 0; j < d; ++j) {
      double dot = 0;
      for (int64_t i = k; i < d; ++i) dot += u[i] * q[i * d + j];
      for (int64_t i = k; i < d; ++i) q[i * d + j] -= 2 * dot * u[i];
    }
  }
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j) q[i * d + j] *= sign[j];
  return q;
}

}  // namespace

FeatureKind parse_feature_kind(const std::string& kind) {
  if (kind == "iid") return FeatureKind::IID;
  if (kind == "orthogonal") return FeatureKind::Orthogonal;
  if (kind == "orthogonal_fixed") return FeatureKind::OrthogonalFixed;
  if (kind == "quantile") return FeatureKind::Quantile;
  fail("random_features: kind must be one of \"iid\", \"orthogonal\", \"orthogonal_fixed\", "
       "\"quantile\"; got \"", kind, "\"");
}

const char* feature_kind_name(FeatureKind kind) {
  switch (kind) {
    case FeatureKind::IID: return "iid";
    case FeatureKind::Orthogonal: return "orthogonal";
    case FeatureKind::OrthogonalFixed: return "orthogonal_fixed";
    case FeatureKind::Quantile: return "quantile";
  }
  return "?";
}

double chi_cdf(double x, int64_t d) {
  if (x <= 0) return 0;
  return boost::math::gamma_p(0.5 * static_cast<double>(d), 0.5 * x * x);
}

std::vector<double> chi_quantile_radii(int64_t m, int64_t d) {
  std::vector<double> r(static_cast<size_t>(m));
  for (int64_t i = 1; i <= m; ++i) {
    const double p = static_cast<double>(i) / static_cast<double>(m + 1);
    // chi-square(d) quantile = 2·P⁻¹(d/2, p)
    r[i - 1] = std::sqrt(2.0 * boost::math::gamma_p_inv(0.5 * static_cast<double>(d), p));
  }
  return r;
}

template <class T>
Tensor<T> random_features(int64_t m, int64_t d, FeatureKind kind, uint64_t seed) {
  require(m >= 1, "random_features: num_features must be >= 1, got ", m);
  require(d >= 1, "random_features: head_dim must be >= 1, got ", d);
  Tensor<T> w({m, d});
  Rng rng(seed);
  if (kind == FeatureKind::IID) {
    for (int64_t i = 0; i < m * d; ++i) w[i] = static_cast<T>(rng.normal());
    return w;
  }
  std::vector<double> radii;
  if (kind == FeatureKind::Quantile) {
    radii = chi_quantile_radii(m, d);
    for (int64_t i = m - 1; i > 0; --i) {  // Fisher–Yates with our generator
      const auto j = static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(i + 1));
      std::swap(radii[i], radii[j]);
    }
  }
  for (int64_t row0 = 0; row0 < m; row0 += d) {
    std::vector<double> g(static_cast<size_t>(d * d));
    for (auto& x : g) x = rng.normal();
    const std::vector<double> q = haar_orthogonal(std::move(g), d);
    for (int64_t r = 0; r < std::min(d, m - row0); ++r) {
      double norm;
      switch (kind) {
        case FeatureKind::Orthogonal: {  // chi(d): the norm of a fresh Gaussian vector
          double s = 0;
          for (int64_t c = 0; c < d; ++c) {
            const double z = rng.normal();
            s += z * z;
          }
          norm = std::sqrt(s);
          break;
        }
        case FeatureKind::OrthogonalFixed: norm = std::sqrt(static_cast<double>(d)); break;
        default: norm = radii[row0 + r]; break;
      }
      // Row r of Q: the blocks' directions are Q's rows (orthonormal since Q is orthogonal).
      for (int64_t c = 0; c < d; ++c) w[(row0 + r) * d + c] = static_cast<T>(norm * q[r * d + c]);
    }
  }
  return w;
}

template Tensor<float> random_features<float>(int64_t, int64_t, FeatureKind, uint64_t);
template Tensor<double> random_features<double>(int64_t, int64_t, FeatureKind, uint64_t);

}  // namespace linattn
