#include "linattn/core/error.h"
#include "linattn/random_features.h"

#include <boost/math/special_functions/gamma.hpp>
#include <cmath>
#include <numeric>
#include <vector>

#include "linattn/core/random.h"

namespace linattn {
namespace {

// Σ a[i]·b[i] in a fixed order (four interleaved partial sums): the same result on every
// machine, unlike a BLAS dot whose kernel and so its rounding depend on the CPU.
double dot(const double* a, const double* b, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// r orthonormal vectors of length d (r <= d), Haar-distributed: the first r columns of Q in the
// QR factorisation of a d×r Gaussian matrix G, with each column's sign fixed so that R has a
// positive diagonal (Mezzadri 2007). Householder reflections on column-major storage, so every
// inner loop runs over contiguous memory: O(d·r²), where the previous full d×d factorisation
// with strided access was O(d³) at ~30 MFLOP/s (random_features(16, 1024) took 26 s).
// g: the d×r matrix, column j at g[j·d]; returns Q's columns the same way.
std::vector<double> haar_columns(std::vector<double> g, int64_t d, int64_t r) {
  std::vector<double> sign(static_cast<size_t>(r), 1.0);
  std::vector<double> v(static_cast<size_t>(r * d), 0.0);  // reflector k in v[k·d + k..d)
  for (int64_t k = 0; k < r; ++k) {
    double* x = g.data() + k * d;
    const double norm = std::sqrt(dot(x + k, x + k, d - k));
    const double alpha = x[k] > 0 ? -norm : norm;  // R_kk = alpha
    sign[k] = alpha > 0 ? 1.0 : -1.0;
    double* u = v.data() + k * d;
    std::copy(x + k, x + d, u + k);
    u[k] -= alpha;
    const double unorm = std::sqrt(dot(u + k, u + k, d - k));
    if (unorm == 0) continue;  // x is already alpha·e_k
    for (int64_t i = k; i < d; ++i) u[i] /= unorm;
    for (int64_t j = k + 1; j < r; ++j) {  // G := (I − 2uuᵀ) G, columns right of k
      double* col = g.data() + j * d;
      const double f = 2 * dot(u + k, col + k, d - k);
      for (int64_t i = k; i < d; ++i) col[i] -= f * u[i];
    }
  }
  // Q's first r columns: H_0 H_1 … H_{r−1} applied to e_0 … e_{r−1}. Reflector k leaves e_j,
  // j < k, alone (its vector is zero above row k), so column j needs reflectors k <= j only.
  std::vector<double> q(static_cast<size_t>(r * d), 0.0);
  for (int64_t j = 0; j < r; ++j) {
    double* col = q.data() + j * d;
    col[j] = 1;
    for (int64_t k = j; k >= 0; --k) {
      const double* u = v.data() + k * d;
      const double f = 2 * dot(u + k, col + k, d - k);
      if (f != 0)
        for (int64_t i = k; i < d; ++i) col[i] -= f * u[i];
    }
    for (int64_t i = 0; i < d; ++i) col[i] *= sign[j];
  }
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
  require(d >= 1, "chi_quantile_radii: head_dim must be >= 1, got ", d);
  sized_by_arguments("chi_quantile_radii", "the radii", {{"num_features", m}}, sizeof(double));
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
  sized_by_arguments("random_features", "the projection", {{"num_features", m}, {"head_dim", d}},
                     sizeof(T));
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
    // This block's directions: the rows it needs (d, or what is left of m), orthonormal.
    const int64_t r = std::min(d, m - row0);
    sized_by_arguments("random_features", "the orthogonalisation workspace",
                       {{"head_dim", d}, {"rows of the block", r}}, sizeof(double), 3);
    std::vector<double> g(static_cast<size_t>(d * r));
    for (auto& x : g) x = rng.normal();
    const std::vector<double> q = haar_columns(std::move(g), d, r);
    for (int64_t j = 0; j < r; ++j) {
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
        default: norm = radii[static_cast<size_t>(row0 + j)]; break;
      }
      for (int64_t c = 0; c < d; ++c) w[(row0 + j) * d + c] = static_cast<T>(norm * q[j * d + c]);
    }
  }
  return w;
}

template Tensor<float> random_features<float>(int64_t, int64_t, FeatureKind, uint64_t);
template Tensor<double> random_features<double>(int64_t, int64_t, FeatureKind, uint64_t);

}  // namespace linattn
