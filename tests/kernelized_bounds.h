// Error bounds for the fast kernelized attention (float32 or float64 arithmetic) against the
// exact float64 result, element by element, derived to first order in the unit roundoff u:
//
//  features  each computed feature has an absolute error E_r:
//            elu 2.6u|φ| + 2⁻¹²⁶ in float32 (exp within 1.3 ulp, simd.cc's ExpNonPositive, an ulp
//            being at most 2u|φ|; 0 below 2⁻¹²⁶), 2u|φ| in float64 (Highway's exp, 1 ulp); relu and
//            given 0; focused γ_{d+8}|φ| (pow,
//            two norms, sqrt, division); FAVOR: U_r = √scale·x·ω_r has |δU_r| ≤
//            γ_{d+1}·√scale·Σ_c|x_c ω_rc| + u|U_r|, and the exponent, the stabilising log-scales
//            (bounded by L = max |ls| over all rows) and exp add up to
//            η_row = 2·max_r|δU_r| + 2γ_{d+3}·h + u·(4(max|U| + h) + 2L) + 8u (h = ‖x̃‖²/2):
//            positive/hyperbolic E_r = η_row·φ_r; trig E_r = amp·(|δU_r| + 4u) + η_row·|φ_r|,
//            amp = e^h/√m (sin/cos within 3 ulp).
//  scores    A_ij = φq_i·φk_j: |δA_ij| ≤ Σ_r (Eq|φk| + |φq|Ek + Eq·Ek) + γ_{m'+2}·Σ_r|φq φk|.
//  sums      num_i = Σ_j A_ij v_j and den_i = Σ_j A_ij are computed as φq·(Σ_j φk v) in blocks:
//            add γ_{n+m'+4}·Σ_j |A|_ij |v_j| (resp. Σ_j |A|_ij), |A| = Σ_r|φq φk|.
//  output    out = num/(den + eps): |δout| ≤ (δnum + |out|·δden)/(|D| − δden) + 2u|out|.
//  gradients to first order, |δg| ≤ ε·M_g with M_g the same sums over absolute values
//            (|dA_ij| = |g_i|·(|v_j| + |out_i|)/|D_i|, then through |φ| + E and the Jacobian's
//            terms in the split form the fast path evaluates, e.g. |ω||g∘φ| + |x̃||g·φ|) and
//            ε = γ_{n+m'+d+dv+16} + 6·max(E/φ̄) + 4·max(δden/(|D| − δden)): every path through the
//            backward multiplies at most six perturbed features and one denominator.
//  bfloat16 products (Products::Bfloat16, the registry's bfloat16 calls): every operand of a
//            product is rounded to bfloat16 (u_b = 2⁻⁸) first. q, k, v, dout and ω are bfloat16
//            values already (exact); the features are rounded where they enter a product, so E_r
//            gains u_b·|φ_r|; a state, a chunk's W or a block's [num | den] sums enter rounded,
//            so the sums gain u_b (g_sum + u_b); in the backward each path also rounds
//            [dnum | dden] or P, a state or its gradient, dφ∘φ before the product with ω, and the
//            saved out (bfloat16) that dden reads: ε + 4·u_b. u_b is large enough that second-
//            order terms matter (ten roundings of 2⁻⁸ compound to 4% more than their sum), so
//            each u_b here is u_b/(1 − 10·u_b), as γ_n = nu/(1 − nu) does for float32. Subnormal
//            operands and results flush to zero (an error of 2⁻¹²⁶·|other operand| per term),
//            which these bounds leave out: the tests' inputs keep every feature, state and
//            gradient operand far above 2⁻¹²⁶.
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/kernelized.h"
#include "linattn/kernelized/reference.h"
#include "test_util.h"

namespace linattn::testing {

struct KernelizedSpec {
  std::string map;  // elu relu given focused positive hyperbolic trig
  bool causal = false;
  std::optional<std::vector<int64_t>> key_lengths;
  double eps = 1e-6;  // linear only
  double focus_power = 3;
  double scale = 0;   // favor: 0 means 1/sqrt(d)
  bool favor() const { return map == "positive" || map == "hyperbolic" || map == "trig"; }
  FavorOptions favor_options() const {
    FavorOptions o;
    o.kernel = map;
    o.causal = causal;
    o.key_lengths = key_lengths;
    if (scale > 0) o.scale = scale;
    return o;
  }
  LinearAttentionOptions linear_options() const {
    LinearAttentionOptions o;
    o.feature_map = map;
    o.causal = causal;
    o.key_lengths = key_lengths;
    o.eps = eps;
    o.focus_power = focus_power;
    return o;
  }
};

struct KernelizedExact {
  Tensor<double> out, out_bound, dq, dk, dv, dq_bound, dk_bound, dv_bound;
};

template <class T>
KernelizedExact kernelized_exact_with_bounds(const Tensor<double>& q, const Tensor<double>& k,
                                             const Tensor<double>& v, const Tensor<double>& dout,
                                             const Tensor<double>* projection,
                                             const KernelizedSpec& spec, bool bf16_products = false) {
  const int64_t B = q.dim(0), H = q.dim(1), nq = q.dim(2), nk = k.dim(2), d = q.dim(3), dv = v.dim(3);
  const double u = unit_roundoff<T>();
  const double ub = bf16_products ? std::ldexp(1.0, -8) / (1 - 10 * std::ldexp(1.0, -8)) : 0.0;
  const double scale = spec.scale > 0 ? spec.scale : 1 / std::sqrt(double(d));
  const double s = std::sqrt(scale);
  AttentionOptions mo;
  mo.causal = spec.causal;
  mo.key_lengths = spec.key_lengths;
  const KeyMask mask({B, H, nq, nk, d, dv}, mo);
  const double eps = spec.favor() ? 0.0 : spec.eps;

  // Exact values from the reference.
  KernelizedExact r;
  if (spec.favor()) {
    FavorOptions fo = spec.favor_options();
    fo.scale = scale;
    r.out = reference::favor_attention(q, k, v, *projection, fo);
    auto g = reference::favor_attention_backward(q, k, v, *projection, dout, fo);
    r.dq = std::move(g.dq), r.dk = std::move(g.dk), r.dv = std::move(g.dv);
  } else {
    const LinearAttentionOptions lo = spec.linear_options();
    r.out = reference::linear_attention(q, k, v, lo);
    auto g = reference::linear_attention_backward(q, k, v, dout, lo);
    r.dq = std::move(g.dq), r.dk = std::move(g.dk), r.dv = std::move(g.dv);
  }
  r.out_bound = Tensor<double>(r.out.shape());
  r.dq_bound = Tensor<double>(q.shape());
  r.dk_bound = Tensor<double>(k.shape());
  r.dv_bound = Tensor<double>(v.shape());

  // Features, Jacobians and feature errors of every row of one (b, h).
  struct Rows {
    Tensor<double> phi, jac, err;
    std::vector<double> rel;  // E/φ̄ per row (max over features)
  };
  // The plain maps' features take no projection, whatever the caller passed.
  if (!spec.favor()) projection = nullptr;
  const int64_t m_proj = projection ? projection->dim(0) : 0;
  auto rows_of = [&](const Tensor<double>& x, int64_t bh, int64_t n, double lmax) {
    Tensor<double> xs({n, d});
    for (int64_t i = 0; i < n * d; ++i) xs[i] = x[bh * n * d + i];
    Rows out;
    out.phi = reference::features(xs, spec.map,
                                  projection ? std::optional<TensorView<const double>>(*projection)
                                             : std::nullopt,
                                  scale, spec.focus_power, &out.jac);
    const int64_t m = out.phi.dim(1);
    out.err = Tensor<double>({n, m});
    out.rel.assign(static_cast<size_t>(n), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const double* xr = xs.data() + i * d;
      double eta = 0, h = 0, amp = 0;
      std::vector<double> dU(static_cast<size_t>(std::max<int64_t>(m_proj, 1)), 0.0);
      if (spec.favor()) {
        double umax = 0;
        for (int64_t c = 0; c < d; ++c) h += 0.5 * scale * xr[c] * xr[c];
        for (int64_t rr = 0; rr < m_proj; ++rr) {
          double U = 0, absU = 0;
          for (int64_t c = 0; c < d; ++c) {
            U += s * xr[c] * (*projection)[rr * d + c];
            absU += s * std::abs(xr[c] * (*projection)[rr * d + c]);
          }
          dU[rr] = gamma<T>(d + 1) * absU + u * std::abs(U);
          umax = std::max(umax, std::abs(U));
        }
        const double dUmax = *std::max_element(dU.begin(), dU.end());
        eta = 2 * dUmax + 2 * gamma<T>(d + 3) * h + u * (4 * (umax + h) + 2 * lmax) + 8 * u;
        amp = std::exp(h) / std::sqrt(double(m_proj));
      }
      for (int64_t rr = 0; rr < m; ++rr) {
        const double phi = std::abs(out.phi[i * m + rr]);
        double e;
        if (spec.map == "elu") e = std::is_same_v<T, float> ? 2.6 * u * phi + std::ldexp(1.0, -126) : 2 * u * phi;
        else if (spec.map == "relu" || spec.map == "given") e = 0;
        else if (spec.map == "focused") e = gamma<T>(d + 8) * phi;
        else if (spec.map == "trig") e = amp * (dU[rr % m_proj] + 4 * u) + eta * phi;
        else e = eta * phi;
        e += ub * phi;  // (trig never takes bfloat16 products: its callers leave ub = 0)
        out.err[i * m + rr] = e;
        const double bar = spec.map == "trig" ? amp : phi;
        if (bar > 0) out.rel[i] = std::max(out.rel[i], e / bar);
      }
    }
    return out;
  };
  // L: the largest |log-scale| any row can get (FAVOR), for the stabilisation error.
  double lmax = 0;
  if (spec.favor()) {
    for (const Tensor<double>* x : {&q, &k})
      for (int64_t row = 0; row < x->size() / d; ++row) {
        double h = 0, umax = 0;
        for (int64_t c = 0; c < d; ++c) h += 0.5 * scale * (*x)[row * d + c] * (*x)[row * d + c];
        for (int64_t rr = 0; rr < m_proj; ++rr) {
          double U = 0;
          for (int64_t c = 0; c < d; ++c) U += s * (*x)[row * d + c] * (*projection)[rr * d + c];
          umax = std::max(umax, std::abs(U));
        }
        lmax = std::max(lmax, umax + h + std::log(2.0 * m_proj));
      }
  }

  for (int64_t b = 0; b < B; ++b)
    for (int64_t hh = 0; hh < H; ++hh) {
      const int64_t bh = b * H + hh;
      const Rows fq = rows_of(q, bh, nq, lmax), fk = rows_of(k, bh, nk, lmax);
      const int64_t m = fq.phi.dim(1);
      const double g_sum = gamma<T>(double(nk + m + 4)) + ub;
      double rel_max = 0;
      for (double x : fq.rel) rel_max = std::max(rel_max, x);
      for (double x : fk.rel) rel_max = std::max(rel_max, x);
      std::vector<double> Dv(nq), dden_rel(nq, 0.0);
      std::vector<std::vector<double>> absA(nq, std::vector<double>(nk, 0.0)),
          dA(nq, std::vector<double>(nk, 0.0));
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t nvis = mask.visible(b, i);
        double den = 0, dden = 0;
        std::vector<double> A(nvis);
        for (int64_t j = 0; j < nvis; ++j) {
          double a = 0, aa = 0, e = 0;
          for (int64_t rr = 0; rr < m; ++rr) {
            const double pq = fq.phi[i * m + rr], pk = fk.phi[j * m + rr];
            const double eq = fq.err[i * m + rr], ek = fk.err[j * m + rr];
            a += pq * pk;
            aa += std::abs(pq * pk);
            e += eq * std::abs(pk) + std::abs(pq) * ek + eq * ek;
          }
          A[j] = a;
          absA[i][j] = aa;
          dA[i][j] = e + gamma<T>(double(m + 2)) * aa;
          den += a;
          dden += dA[i][j] + g_sum * aa;
        }
        const double D = den + eps;
        Dv[i] = D;
        const bool ok = std::abs(D) > dden;
        dden_rel[i] = ok && D != 0 ? dden / (std::abs(D) - dden) : 0;
        for (int64_t c = 0; c < dv; ++c) {
          double dnum = 0;
          for (int64_t j = 0; j < nvis; ++j) {
            const double vj = std::abs(v[(bh * nk + j) * dv + c]);
            dnum += dA[i][j] * vj + g_sum * absA[i][j] * vj;
          }
          const double o = std::abs(r.out[(bh * nq + i) * dv + c]);
          r.out_bound[(bh * nq + i) * dv + c] =
              D == 0 ? 0.0 : ok ? (dnum + o * dden) / (std::abs(D) - dden) + 2 * u * o
                                : std::numeric_limits<double>::infinity();
        }
      }
      // Gradient magnitudes.
      double dden_max = 0;
      for (double x : dden_rel) dden_max = std::max(dden_max, x);
      const double eps_g = gamma<T>(double(nk + nq + m + d + dv + 16)) + 6 * rel_max + 4 * dden_max + 4 * ub;
      std::vector<double> Mphiq(nq * m, 0.0), Mphik(nk * m, 0.0);
      for (int64_t i = 0; i < nq; ++i) {
        if (Dv[i] == 0) continue;
        const double* g = dout.data() + (bh * nq + i) * dv;
        const double* o = r.out.data() + (bh * nq + i) * dv;
        for (int64_t j = 0; j < mask.visible(b, i); ++j) {
          const double* vj = v.data() + (bh * nk + j) * dv;
          double gv = 0;
          for (int64_t c = 0; c < dv; ++c) {
            gv += std::abs(g[c]) * (std::abs(vj[c]) + std::abs(o[c]));
            r.dv_bound[(bh * nk + j) * dv + c] +=
                eps_g * (absA[i][j] + dA[i][j]) * std::abs(g[c]) / std::abs(Dv[i]);
          }
          const double mdA = gv / std::abs(Dv[i]);
          for (int64_t rr = 0; rr < m; ++rr) {
            Mphiq[i * m + rr] += mdA * (std::abs(fk.phi[j * m + rr]) + fk.err[j * m + rr]);
            Mphik[j * m + rr] += mdA * (std::abs(fq.phi[i * m + rr]) + fq.err[i * m + rr]);
          }
        }
      }
      // dx magnitudes as the fast path forms them (split terms, see feature_map.cc).
      auto grad_mag = [&](const Tensor<double>& x, int64_t row, const Rows& f, int64_t i,
                          const std::vector<double>& Mphi, double* outb) {
        const double* xr = x.data() + row * d;
        const double* ph = f.phi.data() + i * m;
        const double* mp = Mphi.data() + i * m;
        if (spec.map == "elu" || spec.map == "relu" || spec.map == "given") {
          for (int64_t c = 0; c < d; ++c) outb[c] = eps_g * std::abs(f.jac[(i * m + c) * d + c]) * mp[c];
        } else if (spec.map == "focused") {
          double R2 = 0, A2 = 0, ga = 0;
          std::vector<double> rv(d), av(d);
          for (int64_t c = 0; c < d; ++c) {
            rv[c] = std::max(xr[c], 0.0);
            av[c] = rv[c] > 0 ? std::pow(rv[c], spec.focus_power) : 0;
            R2 += rv[c] * rv[c];
            A2 += av[c] * av[c];
            ga += mp[c] * av[c];
          }
          const double R = std::sqrt(R2), A = std::sqrt(A2);
          for (int64_t c = 0; c < d; ++c)
            outb[c] = rv[c] <= 0 || A == 0 ? 0.0
                      : eps_g * (ga / A * rv[c] / R + (R * mp[c] / A + R * ga * av[c] / (A * A * A)) *
                                                          spec.focus_power * std::pow(rv[c], spec.focus_power - 1));
        } else {
          double h = 0, gphi = 0;
          for (int64_t c = 0; c < d; ++c) h += 0.5 * scale * xr[c] * xr[c];
          const double amp = std::exp(h) / std::sqrt(double(m_proj));
          for (int64_t rr = 0; rr < m; ++rr) gphi += std::abs(ph[rr]) * mp[rr];
          for (int64_t c = 0; c < d; ++c) {
            double acc = s * s * std::abs(xr[c]) * gphi;
            for (int64_t rr = 0; rr < m; ++rr) {
              const double partner = spec.map == "trig" ? amp : std::abs(ph[rr]);
              acc += s * std::abs((*projection)[(rr % m_proj) * d + c]) * partner * mp[rr];
            }
            outb[c] = eps_g * acc;
          }
        }
      };
      for (int64_t i = 0; i < nq; ++i)
        grad_mag(q, bh * nq + i, fq, i, Mphiq, r.dq_bound.data() + (bh * nq + i) * d);
      for (int64_t j = 0; j < nk; ++j)
        grad_mag(k, bh * nk + j, fk, j, Mphik, r.dk_bound.data() + (bh * nk + j) * d);
    }
  return r;
}

// The RecurrentOptions (and StateOptions) of a map named as KernelizedSpec names it.
inline RecurrentOptions recurrent_options(const std::string& map) {
  RecurrentOptions o;
  if (map == "positive" || map == "hyperbolic" || map == "trig") {
    o.feature_map = "favor";
    o.kernel = map;
  } else {
    o.feature_map = map;
  }
  return o;
}

}  // namespace linattn::testing
