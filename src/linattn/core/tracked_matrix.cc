#include "linattn/core/tracked_matrix.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "linattn/core/error.h"

namespace linattn::reference {

Tracked input(const double* data, int64_t rows, int64_t cols, int64_t ld) {
  Tracked x(rows, cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) x.v(i, j) = data[i * ld + j];
  return x;
}

Tracked transpose(const Tracked& x) {
  Tracked t(x.cols, x.rows);
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t j = 0; j < x.cols; ++j) {
      t.v(j, i) = x.v(i, j);
      t.e(j, i) = x.e(i, j);
    }
  return t;
}

Tracked matmul(const Arith& a, const Tracked& A, bool trans_a, const Tracked& B, bool trans_b,
               double alpha) {
  const int64_t M = trans_a ? A.cols : A.rows, K = trans_a ? A.rows : A.cols;
  const int64_t N = trans_b ? B.rows : B.cols, KB = trans_b ? B.cols : B.rows;
  require(K == KB, "reference::matmul: inner dimensions differ (", K, " and ", KB, ")");
  auto av = [&](int64_t i, int64_t k) { return trans_a ? A.v(k, i) : A.v(i, k); };
  auto ae = [&](int64_t i, int64_t k) { return trans_a ? A.e(k, i) : A.e(i, k); };
  auto bv = [&](int64_t k, int64_t j) { return trans_b ? B.v(j, k) : B.v(k, j); };
  auto be = [&](int64_t k, int64_t j) { return trans_b ? B.e(j, k) : B.e(k, j); };
  const double g = a.gamma(double(K) + 2);
  Tracked C(M, N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0, abs_prod = 0, prop = 0;
      if (a.u == 0) {  // a plain reference: every bound is 0
        for (int64_t k = 0; k < K; ++k) s += av(i, k) * bv(k, j);
      } else {
        for (int64_t k = 0; k < K; ++k) {
          const double x = av(i, k), y = bv(k, j), dx = ae(i, k), dy = be(k, j);
          s += x * y;
          abs_prod += std::abs(x * y);
          prop += std::abs(x) * dy + dx * std::abs(y) + dx * dy;
        }
      }
      C.v(i, j) = alpha * s;
      C.e(i, j) = std::abs(alpha) * (g * abs_prod + prop);
    }
  return C;
}

Tracked add(const Arith& a, const Tracked& A, const Tracked& B, double c) {
  require(A.rows == B.rows && A.cols == B.cols, "reference::add: shapes differ");
  Tracked C(A.rows, A.cols);
  for (size_t i = 0; i < C.val.size(); ++i) {
    C.val[i] = A.val[i] + c * B.val[i];
    C.err[i] = A.err[i] + std::abs(c) * B.err[i] + 2 * a.u * (std::abs(A.val[i]) + std::abs(c * B.val[i]));
  }
  return C;
}

Tracked scale(const Arith& a, const Tracked& X, double c) {
  Tracked C(X.rows, X.cols);
  for (size_t i = 0; i < C.val.size(); ++i) {
    C.val[i] = c * X.val[i];
    C.err[i] = std::abs(c) * X.err[i] + 2 * a.u * std::abs(C.val[i]);
  }
  return C;
}

Tracked identity_minus(const Arith& a, double c, const Tracked& X) {
  Tracked C(X.rows, X.cols);
  for (int64_t i = 0; i < X.rows; ++i)
    for (int64_t j = 0; j < X.cols; ++j) {
      C.v(i, j) = (i == j ? c : 0.0) - X.v(i, j);
      C.e(i, j) = X.e(i, j) + a.u * std::abs(C.v(i, j));
    }
  return C;
}

Bounded zero_bounded(const Shape& shape) { return {Tensor<double>(shape), Tensor<double>(shape)}; }

void store(const Tracked& x, Bounded& r, int64_t offset, int64_t ld) {
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t j = 0; j < x.cols; ++j) {
      r.value[offset + i * ld + j] = x.v(i, j);
      r.bound[offset + i * ld + j] = x.e(i, j);
    }
}

void store_head(const Tracked& x, Bounded& r, int64_t bh) {
  const int64_t n = r.value.dim(2), c = r.value.dim(3);
  store(x, r, bh * n * c, c);
}

Tracked softmax_rows(const Arith& a, const Tracked& S) {
  Tracked P(S.rows, S.cols);
  for (int64_t i = 0; i < S.rows; ++i) {
    double mx = -INFINITY, ds = 0;
    for (int64_t j = 0; j < S.cols; ++j) {
      mx = std::max(mx, S.v(i, j));
      ds = std::max(ds, S.e(i, j));
    }
    double sum = 0, eps = 0;
    for (int64_t j = 0; j < S.cols; ++j) {
      P.v(i, j) = std::exp(S.v(i, j) - mx);
      sum += P.v(i, j);
      eps = std::max(eps, std::expm1(2 * ds + a.u * std::abs(S.v(i, j) - mx)) + 2 * a.u);
    }
    const double eta = 2 * eps + a.gamma(double(S.cols) + 3);
    for (int64_t j = 0; j < S.cols; ++j) {
      P.v(i, j) /= sum;
      P.e(i, j) = eta * P.v(i, j);
    }
  }
  return P;
}

Tracked softmax_rows_backward(const Arith& a, const Tracked& P, const Tracked& dP) {
  require(P.rows == dP.rows && P.cols == dP.cols, "reference::softmax_rows_backward: shapes differ");
  Tracked dS(P.rows, P.cols);
  for (int64_t i = 0; i < P.rows; ++i) {
    double delta = 0, abs_sum = 0, prop = 0;
    for (int64_t j = 0; j < P.cols; ++j) {
      delta += P.v(i, j) * dP.v(i, j);
      abs_sum += std::abs(P.v(i, j) * dP.v(i, j));
      prop += P.e(i, j) * std::abs(dP.v(i, j)) + std::abs(P.v(i, j)) * dP.e(i, j) + P.e(i, j) * dP.e(i, j);
    }
    const double delta_err = prop + a.gamma(double(P.cols)) * abs_sum;
    for (int64_t j = 0; j < P.cols; ++j) {
      const double diff = dP.v(i, j) - delta;
      dS.v(i, j) = P.v(i, j) * diff;
      const double diff_err = dP.e(i, j) + delta_err;
      dS.e(i, j) = P.e(i, j) * std::abs(diff) + std::abs(P.v(i, j)) * diff_err + P.e(i, j) * diff_err +
                   2 * a.u * (std::abs(P.v(i, j)) * (std::abs(dP.v(i, j)) + std::abs(delta)));
    }
  }
  return dS;
}

Tracked inverse(const Arith& a, const Tracked& A) {
  require(A.rows == A.cols, "reference::inverse: matrix is ", A.rows, "x", A.cols, ", not square");
  const int64_t m = A.rows;
  // Gauss–Jordan on [A | I] with partial pivoting.
  std::vector<double> w(static_cast<size_t>(m * 2 * m), 0.0);
  auto W = [&](int64_t i, int64_t j) -> double& { return w[static_cast<size_t>(i * 2 * m + j)]; };
  double norm_a = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      W(i, j) = A.v(i, j);
      norm_a += A.v(i, j) * A.v(i, j);
    }
    W(i, m + i) = 1;
  }
  norm_a = std::sqrt(norm_a);
  for (int64_t c = 0; c < m; ++c) {
    int64_t p = c;
    for (int64_t i = c + 1; i < m; ++i)
      if (std::abs(W(i, c)) > std::abs(W(p, c))) p = i;
    require(std::abs(W(p, c)) > 1e-14 * norm_a, "reference::inverse: matrix is singular to working precision");
    if (p != c)
      for (int64_t j = 0; j < 2 * m; ++j) std::swap(W(p, j), W(c, j));
    const double piv = W(c, c);
    for (int64_t j = 0; j < 2 * m; ++j) W(c, j) /= piv;
    for (int64_t i = 0; i < m; ++i) {
      if (i == c || W(i, c) == 0) continue;
      const double f = W(i, c);
      for (int64_t j = 0; j < 2 * m; ++j) W(i, j) -= f * W(c, j);
    }
  }
  Tracked Z(m, m);
  double norm_z = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) {
      Z.v(i, j) = W(i, m + j);
      norm_z += Z.v(i, j) * Z.v(i, j);
    }
  norm_z = std::sqrt(norm_z);
  if (a.u == 0) return Z;
  // |Z||δA| and its ∞-norm, then |Z||δA||Z|.
  std::vector<double> zda(static_cast<size_t>(m * m), 0.0);
  double rho = 0;
  for (int64_t i = 0; i < m; ++i) {
    double row = 0;
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t k = 0; k < m; ++k) s += std::abs(Z.v(i, k)) * A.e(k, j);
      zda[static_cast<size_t>(i * m + j)] = s;
      row += s;
    }
    rho = std::max(rho, row);
  }
  require(rho < 1, "reference::inverse: ‖|A⁻¹||δA|‖∞ = ", rho,
          " >= 1, the matrix is too ill-conditioned for a first-order bound");
  const double u64 = 0x1.0p-53, md = double(m);
  const double svd_err = u64 * (md * md * norm_a * norm_z * norm_z + std::pow(md, 1.5) * norm_z);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t k = 0; k < m; ++k) s += zda[static_cast<size_t>(i * m + k)] * std::abs(Z.v(k, j));
      Z.e(i, j) = s / (1 - rho) + svd_err + a.u * std::abs(Z.v(i, j));
    }
  return Z;
}

}  // namespace linattn::reference
