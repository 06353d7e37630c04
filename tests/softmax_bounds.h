// Forward error bounds for the float32/float64 fast softmax attention against the exact
// (float64) result, derived from the arithmetic, element by element.
//
// With u the unit roundoff of T and γ_n = n·u/(1−n·u):
//  scores   |δs_ij| ≤ γ_{d+2}·scale·Σ_c|q_ic||k_jc|  (the scale rounded to T, a dot product of d
//           terms and one multiply by the scale, before or after it; a dot product is within γ_d
//           with or without fused multiply-adds, Higham §3.1);
//           δs_i = max over visible j.
//  weights  p_ij = exp(s_ij − m_i) with s and m both perturbed, exp within 1 ulp, stored in
//           T: relative error η_i ≤ 2·δs_i + 4u.
//  output   out_i = Σ_j p_ij v_j / Σ_j p_ij: a relative perturbation η of the weights moves a
//           normalised average by at most 2η·max|v|; the sums add γ_{n+16} (16 covers the
//           online rescalings and the final division). |δout_ic| ≤ (2η_i + γ_{n+16})·max_j|v_j|.
//  lse      |δlse_i| ≤ η_i + γ_{n+16} + u·|lse_i|.
//  backward dp_ij = dout_i·v_j: |δdp| ≤ γ_{dv}·Σ_c|dout_ic v_jc|; δ_i = dout_i·out_i:
//           |δδ_i| ≤ γ_{dv}·Σ|dout_ic out_ic| + Σ_c|dout_ic|·|δout_ic|;
//           p_ij = exp(s_ij − lse_i) again: relative error η'_i ≤ δs_i + |δlse_i| + 2u;
//           ds_ij = p_ij(dp_ij − δ_i): |δds| ≤ η'_i p_ij|dp_ij − δ_i| + p_ij(|δdp| + |δδ_i|) + 2u|ds|;
//           dq_i = scale·Σ_j ds_ij k_j: |δdq_ic| ≤ scale·Σ_j (|δds_ij| + γ_{n_k+1}|ds_ij|)|k_jc|;
//           dk_j likewise over i with q; dv_j = Σ_i p_ij dout_i: |δdv_jc| ≤ Σ_i (η'_i + γ_{n_q+1}) p_ij |dout_ic|.
// These are worst-case bounds (every rounding error aligned); measured errors sit far below.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "linattn/core/attention_args.h"
#include "test_util.h"

namespace linattn::testing {

struct SoftmaxExact {
  Tensor<double> out, lse, dq, dk, dv;                      // exact values (float64)
  Tensor<double> out_bound, lse_bound, dq_bound, dk_bound, dv_bound;  // for arithmetic in T
};

template <class T>
SoftmaxExact softmax_exact_with_bounds(const Tensor<double>& q, const Tensor<double>& k,
                                       const Tensor<double>& v, const Tensor<double>& dout,
                                       const AttentionOptions& opts) {
  const int64_t B = q.dim(0), H = q.dim(1), nq = q.dim(2), nk = k.dim(2), d = q.dim(3),
                dv = v.dim(3);
  const double u = unit_roundoff<T>();
  const double scale = opts.scale ? *opts.scale : 1.0 / std::sqrt(double(d));
  const KeyMask mask({B, H, nq, nk, d, dv}, opts);
  SoftmaxExact r{Tensor<double>({B, H, nq, dv}), Tensor<double>({B, H, nq}),
                 Tensor<double>(q.shape()),      Tensor<double>(k.shape()),
                 Tensor<double>(v.shape()),      Tensor<double>({B, H, nq, dv}),
                 Tensor<double>({B, H, nq}),     Tensor<double>(q.shape()),
                 Tensor<double>(k.shape()),      Tensor<double>(v.shape())};
  std::vector<double> s(nk), p(nk), dp(nk), ds(nk), eds(nk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t bh = b * H + h;
      auto row = [&](const Tensor<double>& t, int64_t i) { return t.data() + (bh * t.dim(2) + i) * t.dim(3); };
      auto wrow = [&](Tensor<double>& t, int64_t i) { return t.data() + (bh * t.dim(2) + i) * t.dim(3); };
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t n = mask.visible(b, i);
        double& lse = r.lse[bh * nq + i];
        if (n == 0) {
          lse = -std::numeric_limits<double>::infinity();
          r.lse_bound[bh * nq + i] = 0;
          continue;  // out, grads of this row stay exactly 0
        }
        double mx = -INFINITY, ds_max = 0, vmax = 0;
        for (int64_t j = 0; j < n; ++j) {
          double dot = 0, absdot = 0;
          for (int64_t c = 0; c < d; ++c) {
            dot += row(q, i)[c] * row(k, j)[c];
            absdot += std::abs(row(q, i)[c] * row(k, j)[c]);
          }
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
          ds_max = std::max(ds_max, gamma<T>(d + 2) * std::abs(scale) * absdot);
          for (int64_t c = 0; c < dv; ++c) vmax = std::max(vmax, std::abs(row(v, j)[c]));
        }
        double sum = 0;
        for (int64_t j = 0; j < n; ++j) sum += std::exp(s[j] - mx);
        lse = mx + std::log(sum);
        const double eta = 2 * ds_max + 4 * u;
        const double g_n = gamma<T>(n + 16);
        const double out_err = (2 * eta + g_n) * vmax;
        r.lse_bound[bh * nq + i] = eta + g_n + u * std::abs(lse);
        double* o = wrow(r.out, i);
        for (int64_t j = 0; j < n; ++j) {
          p[j] = std::exp(s[j] - lse);
          for (int64_t c = 0; c < dv; ++c) o[c] += p[j] * row(v, j)[c];
        }
        for (int64_t c = 0; c < dv; ++c) wrow(r.out_bound, i)[c] = out_err;
        // Backward of this row: p is recomputed as exp(s − lse) from the forward's lse.
        const double eta_b = ds_max + r.lse_bound[bh * nq + i] + 2 * u;
        const double* go = row(dout, i);
        double delta = 0, delta_err = 0;
        for (int64_t c = 0; c < dv; ++c) {
          delta += go[c] * o[c];
          delta_err += gamma<T>(dv) * std::abs(go[c] * o[c]) + std::abs(go[c]) * out_err;
        }
        for (int64_t j = 0; j < n; ++j) {
          double dpj = 0, dp_err = 0;
          for (int64_t c = 0; c < dv; ++c) {
            dpj += go[c] * row(v, j)[c];
            dp_err += std::abs(go[c] * row(v, j)[c]);
          }
          dp_err *= gamma<T>(dv);
          ds[j] = p[j] * (dpj - delta);
          eds[j] = eta_b * p[j] * std::abs(dpj - delta) + p[j] * (dp_err + delta_err) +
                   2 * u * std::abs(ds[j]);
        }
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t c = 0; c < d; ++c) {
            wrow(r.dq, i)[c] += scale * ds[j] * row(k, j)[c];
            wrow(r.dq_bound, i)[c] +=
                std::abs(scale) * (eds[j] + gamma<T>(nk + 1) * std::abs(ds[j])) * std::abs(row(k, j)[c]);
            wrow(r.dk, j)[c] += scale * ds[j] * row(q, i)[c];
            wrow(r.dk_bound, j)[c] +=
                std::abs(scale) * (eds[j] + gamma<T>(nq + 1) * std::abs(ds[j])) * std::abs(row(q, i)[c]);
          }
          for (int64_t c = 0; c < dv; ++c) {
            wrow(r.dv, j)[c] += p[j] * go[c];
            wrow(r.dv_bound, j)[c] += (eta_b + gamma<T>(nq + 1)) * p[j] * std::abs(go[c]);
          }
        }
      }
    }
  return r;
}

}  // namespace linattn::testing
