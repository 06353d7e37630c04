// Float64 reference of hybrid_attention (reference.h): for each query row, the weight of every
// visible key, exact e^{s−M}·γ inside the window and φ(q)·φ(k) outside, then out = Σ w v / (Σ w
// + eps); the backward differentiates the same dense expressions by hand.
#include "linattn/hybrid/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "linattn/hybrid/args.h"
#include "linattn/hybrid/internal.h"
#include "linattn/kernelized/reference.h"
#include "linattn/reference_registry.h"

namespace linattn::reference {
namespace {

using hybrid::Setup;

struct Row {
  std::vector<double> weight;  // per visible key j < visible
  std::vector<char> in_window;
  std::vector<double> log_decay;  // per visible key: λ·(p − j) outside the window (the linear part), else 0
  std::vector<double> expo;    // e^{s−M} inside the window, 0 outside (FAVOR: e^{s−R})
  std::vector<double> fq;     // φ(q_i); FAVOR: its logits L_q
  std::vector<std::vector<double>> share;  // FAVOR, outside the window: e^{L_q,r + L_k,jr − R}/m'
  int64_t top = -1;           // the window's maximum (none with FAVOR: its shift is no gradient)
  double den = 0;             // Σ weight + eps (FAVOR: every weight times e^{−R}, eps too)
};

// FAVOR's logits of a row x, from their definition: x̃ = √scale·x, U_r = ω_r·x̃, h = ‖x̃‖²/2;
// positive L_r = U_r − h, hyperbolic [U_r − h, −U_r − h] (queries and keys alike: the window's
// exact weights keep the query's −h from cancelling). φ_r = exp(L_r)/√m'.
std::vector<double> favor_logits(const Setup& s, TensorView<const double> w, const double* x) {
  const int64_t m = w.dim(0), d = s.d.head_dim;
  const double root = std::sqrt(s.scale);
  double h = 0;
  for (int64_t t = 0; t < d; ++t) h += s.scale * x[t] * x[t] / 2;
  std::vector<double> L(static_cast<size_t>(s.features));
  for (int64_t r = 0; r < m; ++r) {
    double u = 0;
    for (int64_t t = 0; t < d; ++t) u += root * w.data[r * d + t] * x[t];
    L[static_cast<size_t>(r)] = u - h;
    if (s.features == 2 * m) L[static_cast<size_t>(m + r)] = -u - h;
  }
  return L;
}

// ∂L_r/∂x_t = ±√scale·ω_rt − scale·x_t (magnitude: the sum of the absolute values).
double favor_logit_slope(const Setup& s, TensorView<const double> w, const double* x, int64_t r, int64_t t,
                         bool magnitude) {
  const int64_t m = w.dim(0);
  const double sign = r < m ? 1 : -1, a = sign * std::sqrt(s.scale) * w.data[(r % m) * s.d.head_dim + t],
               b = s.scale * x[t];
  return magnitude ? std::abs(a) + std::abs(b) : a - b;
}

// φ of one row x [head_dim] by a plain map (elu, relu, focused), from the kernelized reference,
// the one float64 statement of the maps; with jacobian, ∂φ_r/∂x_c as [1, m', head_dim].
std::vector<double> plain_features(const Setup& s, const double* x, Tensor<double>* jacobian = nullptr) {
  const Tensor<double> f = reference::features(TensorView<const double>{x, {1, s.d.head_dim}}, plain_feature_map_name(s.map), std::nullopt, 1.0,
                                               s.opts.focus_power, jacobian);
  return {f.data(), f.data() + s.features};
}

// φ of row r of x (or of the given features).
std::vector<double> features(const Setup& s, TensorView<const double> x, const HybridInputs<double>& in,
                             const std::optional<TensorView<const double>>& given, int64_t bh, int64_t r,
                             bool magnitude) {
  if (s.favor()) return favor_logits(s, *in.projection, x.row(bh, r));
  std::vector<double> f = s.given() ? std::vector<double>(given->row(bh, r), given->row(bh, r) + s.features)
                                               : plain_features(s, x.row(bh, r));
  if (magnitude)
    for (double& y : f) y = std::abs(y);
  return f;
}

// φ(k_j) of every visible key of item bh.
std::vector<std::vector<double>> key_features(const Setup& s, TensorView<const double> k,
                                              const HybridInputs<double>& in, int64_t bh, int64_t L, bool magnitude) {
  std::vector<std::vector<double>> out;
  for (int64_t j = 0; j < L; ++j) out.push_back(features(s, k, in, in.key_features, bh, j, magnitude));
  return out;
}

// FAVOR: the weight of key j is γ·e^{s_ij} inside the window and Σ_r e^{L_q,r + L_k,jr}/m'
// outside, all written as e^{log w − R} with R the row's largest log-weight (an exact rewrite
// in float64, whose exponent range the test inputs stay far inside).
Row favor_row(const Setup& s, Row r, const std::vector<double>& score, const std::vector<std::vector<double>>& fks,
              double gamma, int64_t visible) {
  std::vector<double> logw(static_cast<size_t>(visible));
  double R = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    double lw;
    if (r.in_window[static_cast<size_t>(j)]) {
      lw = std::log(gamma) + score[static_cast<size_t>(j)];
    } else {
      double top = -INFINITY, sum = 0;
      for (int64_t c = 0; c < s.features; ++c) top = std::max(top, r.fq[static_cast<size_t>(c)] + fks[static_cast<size_t>(j)][static_cast<size_t>(c)]);
      for (int64_t c = 0; c < s.features; ++c)
        sum += std::exp(r.fq[static_cast<size_t>(c)] + fks[static_cast<size_t>(j)][static_cast<size_t>(c)] - top);
      lw = top + std::log(sum / static_cast<double>(s.features)) + r.log_decay[static_cast<size_t>(j)];
    }
    logw[static_cast<size_t>(j)] = lw;
    R = std::max(R, lw);
  }
  r.top = -1;
  r.den = visible == 0 || s.opts.eps == 0 ? s.opts.eps : std::exp(std::log(s.opts.eps) - R);
  for (int64_t j = 0; j < visible; ++j) {
    const double wt = std::exp(logw[static_cast<size_t>(j)] - R);
    r.weight.push_back(wt);
    r.den += wt;
    const bool win = r.in_window[static_cast<size_t>(j)];
    r.expo.push_back(win ? std::exp(score[static_cast<size_t>(j)] - R) : 0);
    std::vector<double> sh;
    if (!win)
      for (int64_t c = 0; c < s.features; ++c)
        sh.push_back(std::exp(r.fq[static_cast<size_t>(c)] + fks[static_cast<size_t>(j)][static_cast<size_t>(c)] +
                              r.log_decay[static_cast<size_t>(j)] - R) /
                     static_cast<double>(s.features));
    r.share.push_back(std::move(sh));
  }
  return r;
}

Row row(const Setup& s, TensorView<const double> q, TensorView<const double> k, const HybridInputs<double>& in,
        const std::vector<std::vector<double>>& fks, int64_t bh, int64_t i, int64_t L, bool magnitude) {
  const int64_t p = i + s.d.n_k - s.d.n_q, w = s.opts.window;
  const int64_t visible = s.opts.causal ? std::clamp<int64_t>(p + 1, 0, L) : L;
  const double gamma = s.gamma[static_cast<size_t>(bh % s.d.heads)];
  Row r;
  r.fq = features(s, q, in, in.query_features, bh, i, magnitude);
  std::vector<double> score(static_cast<size_t>(visible));
  double M = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    const bool win = (w > 0 && (s.opts.causal ? j > p - w : std::abs(p - j) <= w)) || j < s.opts.sinks;
    r.in_window.push_back(win);
    const double lambda = s.log_decay.empty() ? 0.0 : s.log_decay[static_cast<size_t>(bh % s.d.heads)];
    r.log_decay.push_back(win ? 0.0 : lambda * static_cast<double>(p - j));
    double dot = 0;
    for (int64_t t = 0; t < s.d.head_dim; ++t) dot += q.row(bh, i)[t] * k.row(bh, j)[t];
    score[static_cast<size_t>(j)] = s.scale * dot;
    if (win && score[static_cast<size_t>(j)] > M) M = score[static_cast<size_t>(j)], r.top = j;
  }
  if (s.favor()) return favor_row(s, r, score, fks, gamma, visible);
  r.den = s.opts.eps;
  for (int64_t j = 0; j < visible; ++j) {
    double wt = 0;
    if (r.in_window[static_cast<size_t>(j)]) {
      r.expo.push_back(std::exp(score[static_cast<size_t>(j)] - M));
      wt = gamma * r.expo.back();
    } else {
      r.expo.push_back(0);
      const std::vector<double>& fk = fks[static_cast<size_t>(j)];
      for (int64_t c = 0; c < s.features; ++c) wt += r.fq[static_cast<size_t>(c)] * fk[static_cast<size_t>(c)];
      wt *= std::exp(r.log_decay[static_cast<size_t>(j)]);
    }
    r.weight.push_back(wt);
    r.den += wt;
  }
  return r;
}

}  // namespace

Tensor<double> hybrid_attention(TensorView<const double> q, TensorView<const double> k, TensorView<const double> v,
                                const HybridInputs<double>& in, const HybridAttentionOptions& opts, bool magnitude) {
  const Setup s = hybrid::check_args("reference::hybrid_attention", q, k, v, in, opts);
  const KeyMask mask(s.d, opts);
  Tensor<double> out({s.d.batch, s.d.heads, s.d.n_q, s.d.value_dim});
  auto mag = [magnitude](double x) { return magnitude ? std::abs(x) : x; };
  for (int64_t bh = 0; bh < s.d.bh(); ++bh) {
    const int64_t L = mask.key_length(bh / s.d.heads);
    const auto fks = key_features(s, k, in, bh, L, magnitude);
    for (int64_t i = 0; i < s.d.n_q; ++i) {
      const Row r = row(s, q, k, in, fks, bh, i, L, magnitude);
      if (r.den == 0) continue;
      double* o = out.data() + (bh * s.d.n_q + i) * s.d.value_dim;
      for (size_t j = 0; j < r.weight.size(); ++j)
        for (int64_t t = 0; t < s.d.value_dim; ++t) o[t] += r.weight[j] * mag(v.row(bh, static_cast<int64_t>(j))[t]);
      for (int64_t t = 0; t < s.d.value_dim; ++t) o[t] /= r.den;
    }
  }
  return out;
}

AttentionGrads<double> hybrid_attention_backward(TensorView<const double> q, TensorView<const double> k,
                                                 TensorView<const double> v, TensorView<const double> dout,
                                                 const HybridInputs<double>& in, const HybridAttentionOptions& opts,
                                                 bool magnitude) {
  const Setup s = hybrid::check_args("reference::hybrid_attention_backward", q, k, v, in, opts);
  const AttentionDims& d = s.d;
  const KeyMask mask(d, opts);
  auto mag = [magnitude](double x) { return magnitude ? std::abs(x) : x; };
  const Tensor<double> out = hybrid_attention(q, k, v, in, opts, magnitude);
  AttentionGrads<double> g{Tensor<double>(q.shape), Tensor<double>(k.shape), Tensor<double>(v.shape), {}};
  Tensor<double> dfq_all({d.batch, d.heads, d.n_q, s.features}), dfk_all({d.batch, d.heads, d.n_k, s.features});
  std::vector<double> dgamma(static_cast<size_t>(d.heads), 0.0);
  for (int64_t bh = 0; bh < d.bh(); ++bh) {
    const int64_t L = mask.key_length(bh / d.heads);
    const auto fks = key_features(s, k, in, bh, L, magnitude);
    for (int64_t i = 0; i < d.n_q; ++i) {
      const Row r = row(s, q, k, in, fks, bh, i, L, magnitude);
      if (r.den == 0) continue;
      const double* go = dout.row(bh, i);
      const double* o = out.data() + (bh * d.n_q + i) * d.value_dim;
      // out = num/den: ∂num = dout/den, ∂den = −dout·out/den.
      std::vector<double> gi(static_cast<size_t>(d.value_dim));
      double ci = 0;
      for (int64_t t = 0; t < d.value_dim; ++t) {
        gi[static_cast<size_t>(t)] = mag(go[t]) / r.den;
        ci += mag(go[t]) * o[t];
      }
      ci = magnitude ? ci / r.den : -ci / r.den;
      std::vector<double> ds(r.weight.size(), 0.0);
      double shift = 0;
      for (size_t j = 0; j < r.weight.size(); ++j) {
        const int64_t key = static_cast<int64_t>(j);
        double dw = ci;  // ∂weight_ij = g_i·v_j + c_i
        for (int64_t t = 0; t < d.value_dim; ++t) {
          dw += gi[static_cast<size_t>(t)] * mag(v.row(bh, key)[t]);
          g.dv.data()[(bh * d.n_k + key) * d.value_dim + t] += r.weight[j] * gi[static_cast<size_t>(t)];
        }
        if (r.in_window[j]) {  // weight = γ e^{s − M}
          ds[j] = r.weight[j] * dw;
          shift += ds[j];
          dgamma[static_cast<size_t>(bh % d.heads)] += r.expo[j] * dw;
        } else if (s.favor()) {  // weight = Σ_c e^{L_q,c + L_k,jc}/m': ∂/∂L = the shares
          for (int64_t c = 0; c < s.features; ++c) {
            const double a = dw * r.share[j][static_cast<size_t>(c)];
            dfq_all.data()[(bh * d.n_q + i) * s.features + c] += a;
            dfk_all.data()[(bh * d.n_k + key) * s.features + c] += a;
          }
        } else {  // weight = e^{λ(p − j)}·φ(q_i)·φ(k_j)
          const std::vector<double>& fk = fks[static_cast<size_t>(key)];
          const double dwd = dw * std::exp(r.log_decay[j]);
          for (int64_t c = 0; c < s.features; ++c) {
            dfq_all.data()[(bh * d.n_q + i) * s.features + c] += dwd * fk[static_cast<size_t>(c)];
            dfk_all.data()[(bh * d.n_k + key) * s.features + c] += dwd * r.fq[static_cast<size_t>(c)];
          }
        }
      }
      if (r.top >= 0) ds[static_cast<size_t>(r.top)] += magnitude ? shift : -shift;  // M_i = s_i,top
      for (size_t j = 0; j < ds.size(); ++j) {
        const int64_t key = static_cast<int64_t>(j);
        const double a = mag(s.scale * ds[j]);  // s_ij = scale·q_i·k_j
        for (int64_t t = 0; t < d.head_dim; ++t) {
          g.dq.data()[(bh * d.n_q + i) * d.head_dim + t] += a * mag(k.row(bh, key)[t]);
          g.dk.data()[(bh * d.n_k + key) * d.head_dim + t] += a * mag(q.row(bh, i)[t]);
        }
      }
    }
  }
  if (s.given()) {
    g.params.emplace_back("query_features", std::move(dfq_all));
    g.params.emplace_back("key_features", std::move(dfk_all));
  } else if (s.favor()) {  // dx_t = Σ_r dL_r·∂L_r/∂x_t
    auto chain = [&](TensorView<const double> x, const Tensor<double>& dL, int64_t rows_of_item, Tensor<double>& dx,
                     int64_t n) {
      for (int64_t bh = 0; bh < d.bh(); ++bh)
        for (int64_t row = 0; row < rows_of_item; ++row)
          for (int64_t t = 0; t < d.head_dim; ++t)
            for (int64_t c = 0; c < s.features; ++c)
              dx.data()[(bh * n + row) * d.head_dim + t] +=
                  dL.data()[(bh * n + row) * s.features + c] *
                  favor_logit_slope(s, *in.projection, x.row(bh, row), c, t, magnitude);
    };
    chain(q, dfq_all, d.n_q, g.dq, d.n_q);
    chain(k, dfk_all, d.n_k, g.dk, d.n_k);  // dL of padded keys is 0
  } else {  // dx_t = Σ_c dφ_c·∂φ_c/∂x_t
    auto chain = [&](TensorView<const double> x, const Tensor<double>& dphi, Tensor<double>& dx, int64_t n,
                     auto rows_of_item) {
      Tensor<double> jacobian;
      for (int64_t bh = 0; bh < d.bh(); ++bh)
        for (int64_t row = 0; row < rows_of_item(bh); ++row) {
          plain_features(s, x.row(bh, row), &jacobian);
          for (int64_t t = 0; t < d.head_dim; ++t)
            for (int64_t c = 0; c < s.features; ++c)
              dx.data()[(bh * n + row) * d.head_dim + t] +=
                  dphi.data()[(bh * n + row) * s.features + c] * mag(jacobian.data()[c * d.head_dim + t]);
        }
    };
    chain(q, dfq_all, g.dq, d.n_q, [&](int64_t) { return d.n_q; });
    chain(k, dfk_all, g.dk, d.n_k, [&](int64_t bh) { return mask.key_length(bh / d.heads); });
  }
  if (in.window_gate) {
    Tensor<double> dg({d.heads});
    for (int64_t h = 0; h < d.heads; ++h) {
      const double gam = s.gamma[static_cast<size_t>(h)];
      dg[h] = dgamma[static_cast<size_t>(h)] * gam * (1 - gam);
    }
    g.params.emplace_back("window_gate", std::move(dg));
  }
  return g;
}

ReferenceInfo reference_hybrid() {
  ReferenceInfo r;
  r.rows_independent = false;  // the window of row i depends on its position, not on q_i alone
  r.forward = [](const MethodArgs<double>& a) {
    const auto c = hybrid::call_from(a);
    return hybrid_attention(a.q, a.k, a.v, c.in, c.opts);
  };
  r.backward = [](const MethodArgs<double>& a, TensorView<const double> dout) {
    const auto c = hybrid::call_from(a);
    return hybrid_attention_backward(a.q, a.k, a.v, dout, c.in, c.opts);
  };
  return r;
}

HybridPrefillState hybrid_prefill(TensorView<const double> k, TensorView<const double> v,
                                  TensorView<const double> key_features, TensorView<const bool> valid,
                                  TensorView<const double> log_decay, int64_t window, int64_t sinks, bool magnitude) {
  const int64_t B = k.dim(0), Hkv = k.dim(1), n = k.dim(2), d = k.dim(3), dv = v.dim(3);
  const int64_t H = key_features.dim(1), m = key_features.dim(3), G = H / Hkv, slots = sinks + window;
  HybridPrefillState st{Tensor<double>({B, H, m, dv}), Tensor<double>({B, H, m}), Tensor<double>({B, Hkv, slots, d}),
                        Tensor<double>({B, Hkv, slots, dv}), Tensor<bool>({B, slots}), Tensor<int64_t>({B})};
  for (int64_t b = 0; b < B; ++b) {
    int64_t c = 0;  // the row's tokens
    for (int64_t p = 0; p < n; ++p) c += !valid.data || valid.data[b * n + p] ? 1 : 0;
    st.counts[b] = c;
    int64_t i = 0;  // place of position p among the row's tokens
    for (int64_t p = 0; p < n; ++p) {
      if (valid.data && !valid.data[b * n + p]) continue;
      const int64_t after = c - 1 - i;
      if (after < window || i < sinks) {  // an exact slot: the ring's s + i mod w, or sink slot i
        const int64_t slot = after < window ? sinks + i % window : i;
        st.exact_valid[b * slots + slot] = true;
        for (int64_t g = 0; g < Hkv; ++g) {
          for (int64_t t = 0; t < d; ++t) st.exact_keys[((b * Hkv + g) * slots + slot) * d + t] = k.data[((b * Hkv + g) * n + p) * d + t];
          for (int64_t t = 0; t < dv; ++t)
            st.exact_values[((b * Hkv + g) * slots + slot) * dv + t] = v.data[((b * Hkv + g) * n + p) * dv + t];
        }
      } else {  // the sums: e^{λ_h·after} φ_h(k_p) v_pᵀ for each query head h
        for (int64_t h = 0; h < H; ++h) {
          const double weight = log_decay.data ? std::exp(log_decay.data[h] * static_cast<double>(after)) : 1.0;
          const double* phi = key_features.data + ((b * H + h) * n + p) * m;
          const double* val = v.data + ((b * Hkv + h / G) * n + p) * dv;
          for (int64_t r = 0; r < m; ++r) {
            const double a = weight * (magnitude ? std::abs(phi[r]) : phi[r]);
            st.normaliser[(b * H + h) * m + r] += a;
            for (int64_t t = 0; t < dv; ++t)
              st.sums[((b * H + h) * m + r) * dv + t] += a * (magnitude ? std::abs(val[t]) : val[t]);
          }
        }
      }
      ++i;
    }
  }
  return st;
}

}  // namespace linattn::reference
