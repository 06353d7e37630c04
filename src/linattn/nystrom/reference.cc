#include "linattn/core/attention_args.h"
#include "linattn/nystrom/reference.h"
#include "linattn/nystrom/args.h"
#include "linattn/reference_registry.h"
// Nyström attention in plain float64 loops (tracked_matrix.h), in the association the fast path
// uses, with worst-case rounding bounds for a fast path at unit roundoff u.
#include <cmath>

#include "linattn/core/tracked_matrix.h"
#include "linattn/nystrom/internal.h"

namespace linattn::reference {
namespace {

using nystrom::PinvMethod;

// A scalar with an error bound.
struct Scalar {
  double v = 0, e = 0;
};

// Segment means of the rows of X [L, d] into m landmarks: a sum of len terms and a product
// by 1/len (rounded): |δ| ≤ γ_{len+2}·Σ|x|/len + Σ|δx|/len.
Tracked pool(const Arith& a, const Tracked& X, int64_t m) {
  const int64_t L = X.rows;
  Tracked P(m, X.cols);
  for (int64_t j = 0; j < m; ++j) {
    const int64_t b = segment_begin(j, L, m), e = segment_end(j, L, m), len = e - b;
    for (int64_t c = 0; c < X.cols; ++c) {
      double s = 0, abs_s = 0, err = 0;
      for (int64_t i = b; i < e; ++i) {
        s += X.v(i, c);
        abs_s += std::abs(X.v(i, c));
        err += X.e(i, c);
      }
      P.v(j, c) = s / double(len);
      P.e(j, c) = (a.gamma(double(len) + 2) * abs_s + err) / double(len);
    }
  }
  return P;
}

// X[i] += G[j]·(1/len_j) for each position i of segment j (at most two segments per i).
void add_unpooled(const Arith& a, Tracked& X, const Tracked& G) {
  const int64_t L = X.rows, m = G.rows;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t b = segment_begin(j, L, m), e = segment_end(j, L, m);
    const double inv = 1.0 / double(e - b);
    for (int64_t i = b; i < e; ++i)
      for (int64_t c = 0; c < X.cols; ++c) {
        const double t = G.v(j, c) * inv;
        X.e(i, c) += G.e(j, c) * inv + 2 * a.u * std::abs(t) + a.u * (std::abs(X.v(i, c)) + std::abs(t));
        X.v(i, c) += t;
      }
  }
}

// ‖A‖₁ or ‖A‖∞ (largest column or row sum of |A|), and where.
Scalar norm(const Arith& a, const Tracked& A, bool columns, int64_t& where) {
  Scalar best{-1, 0};
  const int64_t outer = columns ? A.cols : A.rows, inner = columns ? A.rows : A.cols;
  for (int64_t o = 0; o < outer; ++o) {
    double s = 0, e = 0;
    for (int64_t i = 0; i < inner; ++i) {
      const int64_t r = columns ? i : o, c = columns ? o : i;
      s += std::abs(A.v(r, c));
      e += A.e(r, c);
    }
    e += a.gamma(double(inner)) * s;
    if (s > best.v) best = {s, e}, where = o;
  }
  // The fast path may pick another row or column within the errors: bound by the largest.
  for (int64_t o = 0; o < outer; ++o) {
    double s = 0, e = 0;
    for (int64_t i = 0; i < inner; ++i) {
      const int64_t r = columns ? i : o, c = columns ? o : i;
      s += std::abs(A.v(r, c));
      e += A.e(r, c);
    }
    best.e = std::max(best.e, e + a.gamma(double(inner)) * s);
  }
  return best;
}

// c = 1/(‖A‖₁‖A‖∞) with its bound.
Scalar initial_coefficient(const Arith& a, const Tracked& A, int64_t& col, int64_t& row) {
  const Scalar n1 = norm(a, A, true, col), ninf = norm(a, A, false, row);
  const double c = 1 / (n1.v * ninf.v);
  return {c, c * (n1.e / n1.v + ninf.e / ninf.v + 2 * a.u)};
}

struct StepTerms {
  Tracked P, T1, T3, T5;
};
StepTerms step_terms(const Arith& a, const Tracked& A, const Tracked& V) {
  StepTerms s;
  s.P = matmul(a, A, false, V, false);
  s.T1 = identity_minus(a, 7, s.P);
  s.T3 = identity_minus(a, 15, matmul(a, s.P, false, s.T1, false));
  s.T5 = identity_minus(a, 13, matmul(a, s.P, false, s.T3, false));
  return s;
}

}  // namespace

Tracked pinv_initial_iterate(const Arith& a, const Tracked& A) {
  int64_t col = 0, row = 0;
  const Scalar c = initial_coefficient(a, A, col, row);
  Tracked V = transpose(A);
  for (size_t i = 0; i < V.val.size(); ++i) {
    V.err[i] = c.v * V.err[i] + c.e * std::abs(V.val[i]) + a.u * std::abs(c.v * V.val[i]);
    V.val[i] *= c.v;
  }
  return V;
}

Tracked pinv_iteration(const Arith& a, const Tracked& A, const Tracked& V) {
  const StepTerms s = step_terms(a, A, V);
  return matmul(a, V, false, s.T5, false, 0.25);
}

namespace {

Tracked pinv_iterative(const Arith& a, const Tracked& A, int64_t iterations,
                       std::vector<Tracked>* iterates) {
  Tracked V = pinv_initial_iterate(a, A);
  if (iterates) iterates->push_back(V);
  for (int64_t k = 0; k < iterations; ++k) {
    V = pinv_iteration(a, A, V);
    if (iterates) iterates->push_back(V);
  }
  return V;
}

Tracked pinv_iterative_backward(const Arith& a, const Tracked& A, const std::vector<Tracked>& its,
                                const Tracked& dZ) {
  const int64_t m = A.rows;
  Tracked dA(m, m), G = dZ;
  for (int64_t k = static_cast<int64_t>(its.size()) - 2; k >= 0; --k) {
    const Tracked& V = its[static_cast<size_t>(k)];
    const StepTerms s = step_terms(a, A, V);
    Tracked dV = matmul(a, G, false, s.T5, true, 0.25);
    Tracked dT = matmul(a, V, true, G, false, 0.25);
    Tracked dP = matmul(a, dT, false, s.T3, true, -1);
    const Tracked dT2 = matmul(a, s.P, true, dT, false);
    dP = add(a, dP, matmul(a, dT2, false, s.T1, true));
    dT = matmul(a, s.P, true, dT2, false);
    dP = add(a, dP, dT, -1);
    dA = add(a, dA, matmul(a, dP, false, V, true));
    G = add(a, dV, matmul(a, A, true, dP, false));
  }
  int64_t col = 0, row = 0;
  const Scalar c = initial_coefficient(a, A, col, row);
  Scalar dc;
  double dc_abs = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) {
      const double t = c.v * G.v(j, i);
      dA.e(i, j) += c.v * G.e(j, i) + c.e * std::abs(G.v(j, i)) + a.u * std::abs(t) +
                    a.u * (std::abs(dA.v(i, j)) + std::abs(t));
      dA.v(i, j) += t;
      dc.v += G.v(j, i) * A.v(i, j);
      dc_abs += std::abs(G.v(j, i) * A.v(i, j));
      dc.e += G.e(j, i) * std::abs(A.v(i, j)) + std::abs(G.v(j, i)) * A.e(i, j);
    }
  dc.e += a.gamma(double(m * m)) * dc_abs;
  const Scalar n1 = norm(a, A, true, col), ninf = norm(a, A, false, row);
  auto grad_of = [&](const Scalar& nrm) {  // −c/‖·‖·dc
    const double g = -c.v / nrm.v * dc.v;
    return Scalar{g, std::abs(g) * (c.e / c.v + nrm.e / nrm.v + 3 * a.u) + std::abs(c.v / nrm.v) * dc.e};
  };
  const Scalar dn1 = grad_of(n1), dninf = grad_of(ninf);
  auto bump = [&](int64_t i, int64_t j, const Scalar& g) {
    const double sgn = A.v(i, j) > 0 ? 1 : (A.v(i, j) < 0 ? -1 : 0);
    dA.e(i, j) += g.e + a.u * (std::abs(dA.v(i, j)) + std::abs(g.v));
    dA.v(i, j) += sgn * g.v;
  };
  for (int64_t i = 0; i < m; ++i) bump(i, col, dn1);
  for (int64_t j = 0; j < m; ++j) bump(row, j, dninf);
  return dA;
}

Tracked pinv_exact_backward(const Arith& a, const Tracked& A, const Tracked& Z, const Tracked& G) {
  Tracked X = matmul(a, Z, true, G, false);
  Tracked dA = matmul(a, X, false, Z, true, -1);
  Tracked ZZ = matmul(a, Z, false, Z, true);
  X = matmul(a, G, true, ZZ, false);
  Tracked R = identity_minus(a, 1, matmul(a, A, false, Z, false));
  dA = add(a, dA, matmul(a, R, false, X, false));
  ZZ = matmul(a, Z, true, Z, false);
  X = matmul(a, ZZ, false, G, true);
  R = identity_minus(a, 1, matmul(a, Z, false, A, false));
  return add(a, dA, matmul(a, X, false, R, false));
}

// Everything of one head that the forward and backward share.
struct Head {
  Tracked Q, K, V, qt, kt, A, F3, Z, W, Y, F1;
  std::vector<Tracked> iterates;
};

Head head(const Arith& a, const nystrom::Setup& s, TensorView<const double> q,
          TensorView<const double> k, TensorView<const double> v, int64_t bh, int64_t L) {
  const int64_t d = s.d.head_dim, dv = s.d.value_dim, m = std::min(s.max_landmarks, L);
  Head h;
  h.Q = input(q.row(bh, 0), s.d.n_q, d, d);
  h.K = input(k.row(bh, 0), L, d, d);
  h.V = input(v.row(bh, 0), L, dv, dv);
  h.qt = pool(a, input(q.row(bh, 0), L, d, d), m);
  h.kt = pool(a, h.K, m);
  h.A = softmax_rows(a, matmul(a, h.qt, false, h.kt, true, s.scale));
  h.F3 = softmax_rows(a, matmul(a, h.qt, false, h.K, true, s.scale));
  h.Z = s.pinv == PinvMethod::Exact ? inverse(a, h.A) : pinv_iterative(a, h.A, s.iterations, &h.iterates);
  h.W = matmul(a, h.F3, false, h.V, false);
  h.Y = matmul(a, h.Z, false, h.W, false);
  h.F1 = softmax_rows(a, matmul(a, h.Q, false, h.kt, true, s.scale));
  return h;
}


// out[i] += Σ_t w[h,t]·v[i+t−off], added term by term in the fast path: |δ| ≤ γ_{2K}(|out| + Σ|w v|).
void add_conv(const Arith& a, const nystrom::Setup& s, const KeyMask& mask, TensorView<const double> v,
              TensorView<const double> w, Bounded& out) {
  const AttentionDims& d = s.d;
  const int64_t K = w.dim(1), off = (K - 1) / 2;
  for (int64_t bh = 0; bh < d.bh(); ++bh) {
    const int64_t h = bh % d.heads, L = mask.key_length(bh / d.heads);
    for (int64_t i = 0; i < d.n_q; ++i)
      for (int64_t c = 0; c < d.value_dim; ++c) {
        const int64_t idx = (bh * d.n_q + i) * d.value_dim + c;
        double s_abs = std::abs(out.value[idx]);
        for (int64_t t = 0; t < K; ++t) {
          const int64_t j = i + t - off;
          if (j < 0 || j >= L) continue;
          out.value[idx] += w.data[h * K + t] * v.row(bh, j)[c];
          s_abs += std::abs(w.data[h * K + t] * v.row(bh, j)[c]);
        }
        out.bound[idx] += a.gamma(2.0 * double(K)) * s_abs;
      }
  }
}

}  // namespace

Bounded nystrom_attention(TensorView<const double> q, TensorView<const double> k,
                          TensorView<const double> v, const NystromOptions& opts,
                          std::optional<TensorView<const double>> conv_weight, double u) {
  const Arith a{u};
  const nystrom::Setup s = nystrom::check_args("reference::nystrom_attention", q, k, v, opts, conv_weight);
  const KeyMask mask(s.d, s.mask_opts);
  Bounded out = zero_bounded({s.d.batch, s.d.heads, s.d.n_q, s.d.value_dim});
  for (int64_t bh = 0; bh < s.d.bh(); ++bh) {
    const int64_t L = mask.key_length(bh / s.d.heads);
    if (L == 0) continue;
    const Head h = head(a, s, q, k, v, bh, L);
    store_head(matmul(a, h.F1, false, h.Y, false), out, bh);
  }
  if (conv_weight) add_conv(a, s, mask, v, *conv_weight, out);
  return out;
}

std::vector<Bounded> nystrom_attention_backward(TensorView<const double> q,
                                                TensorView<const double> k,
                                                TensorView<const double> v,
                                                TensorView<const double> dout,
                                                const NystromOptions& opts,
                                                std::optional<TensorView<const double>> conv_weight,
                                                double u) {
  const Arith a{u};
  const nystrom::Setup s =
      nystrom::check_args("reference::nystrom_attention_backward", q, k, v, opts, conv_weight);
  const AttentionDims& d = s.d;
  const KeyMask mask(d, s.mask_opts);
  Bounded dq = zero_bounded(q.shape), dk = zero_bounded(k.shape), dv = zero_bounded(v.shape);
  for (int64_t bh = 0; bh < d.bh(); ++bh) {
    const int64_t L = mask.key_length(bh / d.heads);
    if (L == 0) continue;
    const Head h = head(a, s, q, k, v, bh, L);
    const Tracked G = input(dout.row(bh, 0), d.n_q, d.value_dim, d.value_dim);
    const Tracked dY = matmul(a, h.F1, true, G, false);
    const Tracked dS1 = softmax_rows_backward(a, h.F1, matmul(a, G, false, h.Y, true));
    Tracked dQ = matmul(a, dS1, false, h.kt, false, s.scale);
    Tracked dKt = matmul(a, dS1, true, h.Q, false, s.scale);
    const Tracked dZ = matmul(a, dY, false, h.W, true), dW = matmul(a, h.Z, true, dY, false);
    const Tracked dF3 = matmul(a, dW, false, h.V, true);
    const Tracked dV = matmul(a, h.F3, true, dW, false);
    const Tracked dS3 = softmax_rows_backward(a, h.F3, dF3);
    Tracked dQt = matmul(a, dS3, false, h.K, false, s.scale);
    Tracked dK = matmul(a, dS3, true, h.qt, false, s.scale);
    const Tracked dA = s.pinv == PinvMethod::Exact ? pinv_exact_backward(a, h.A, h.Z, dZ)
                                                   : pinv_iterative_backward(a, h.A, h.iterates, dZ);
    const Tracked dS2 = softmax_rows_backward(a, h.A, dA);
    dQt = add(a, dQt, matmul(a, dS2, false, h.kt, false, s.scale));
    dKt = add(a, dKt, matmul(a, dS2, true, h.qt, false, s.scale));
    Tracked dQ_valid = input(dQ.val.data(), L, d.head_dim, d.head_dim);
    std::copy(dQ.err.begin(), dQ.err.begin() + L * d.head_dim, dQ_valid.err.begin());
    add_unpooled(a, dQ_valid, dQt);
    std::copy(dQ_valid.val.begin(), dQ_valid.val.end(), dQ.val.begin());
    std::copy(dQ_valid.err.begin(), dQ_valid.err.end(), dQ.err.begin());
    add_unpooled(a, dK, dKt);
    store_head(dQ, dq, bh);
    store_head(dK, dk, bh);
    store_head(dV, dv, bh);
  }
  std::vector<Bounded> grads;
  grads.push_back(std::move(dq));
  grads.push_back(std::move(dk));
  if (conv_weight) {
    // dv[j] += Σ_t w[h,t]·dout[j−t+off] term by term; dw[h,t] = Σ_{b,i,c} dout·v (inputs only).
    const TensorView<const double> w = *conv_weight;
    const int64_t K = w.dim(1), off = (K - 1) / 2;
    Bounded dw = zero_bounded(w.shape);
    std::vector<double> dw_abs(static_cast<size_t>(w.size()), 0.0);
    for (int64_t bh = 0; bh < d.bh(); ++bh) {
      const int64_t h = bh % d.heads, L = mask.key_length(bh / d.heads);
      for (int64_t j = 0; j < L; ++j)
        for (int64_t c = 0; c < d.value_dim; ++c) {
          const int64_t idx = (bh * d.n_k + j) * d.value_dim + c;
          double s_abs = std::abs(dv.value[idx]);
          for (int64_t t = 0; t < K; ++t) {
            const int64_t i = j - t + off;
            if (i < 0 || i >= d.n_q) continue;
            const double g = dout.row(bh, i)[c];
            dv.value[idx] += w.data[h * K + t] * g;
            s_abs += std::abs(w.data[h * K + t] * g);
            dw.value[h * K + t] += g * v.row(bh, j)[c];
            dw_abs[static_cast<size_t>(h * K + t)] += std::abs(g * v.row(bh, j)[c]);
          }
          dv.bound[idx] += a.gamma(2.0 * double(K)) * s_abs;
        }
    }
    const double terms = double(d.batch * d.n_q * d.value_dim);
    for (int64_t i = 0; i < w.size(); ++i) dw.bound[i] = a.gamma(terms) * dw_abs[static_cast<size_t>(i)];
    grads.push_back(std::move(dv));
    grads.push_back(std::move(dw));
  } else {
    grads.push_back(std::move(dv));
  }
  return grads;
}

}  // namespace linattn::reference

namespace linattn::reference {

ReferenceInfo reference_nystrom() {
  ReferenceInfo r;
  r.forward = [](const MethodArgs<double>& a) {
    const auto c = nystrom::call_from(a);
    return nystrom_attention(a.q, a.k, a.v, c.opts, c.conv_weight).value;
  };
  r.backward = [](const MethodArgs<double>& a, TensorView<const double> dout) {
    const auto c = nystrom::call_from(a);
    auto b = nystrom_attention_backward(a.q, a.k, a.v, dout, c.opts, c.conv_weight);
    AttentionGrads<double> g{std::move(b[0].value), std::move(b[1].value), std::move(b[2].value), {}};
    if (c.conv_weight) g.params.emplace_back("conv_weight", std::move(b[3].value));
    return g;
  };
  r.rows_independent = false;
  return r;
}

}  // namespace linattn::reference
