// Float64 reference of hybrid_attention (reference.h): for each query row, the weight of every
// visible key, exact e^{s−M}·γ inside the window and φ(q)·φ(k) outside, then out = Σ w v / (Σ w
// + eps); the backward differentiates the same dense expressions by hand.
#include "linattn/hybrid/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "linattn/hybrid/args.h"
#include "linattn/hybrid/internal.h"
#include "linattn/reference_registry.h"

namespace linattn::reference {
namespace {

using hybrid::Map;
using hybrid::Setup;

struct Row {
  std::vector<double> weight;  // per visible key j < visible
  std::vector<char> in_window;
  std::vector<double> expo;    // e^{s−M} inside the window, 0 outside
  std::vector<double> fq;     // φ(q_i)
  int64_t top = -1;           // the window's maximum
  double den = 0;             // Σ weight + eps
};

double feature(const Setup& s, double x) { return s.map == Map::Elu ? (x > 0 ? x + 1 : std::exp(x)) : std::max(x, 0.0); }
double feature_slope(const Setup& s, double x) {
  return s.map == Map::Elu ? (x > 0 ? 1 : std::exp(x)) : (x > 0 ? 1.0 : 0.0);
}

// φ of row r of x (or of the given features).
std::vector<double> features(const Setup& s, TensorView<const double> x, const std::optional<TensorView<const double>>& given,
                             int64_t bh, int64_t r, bool magnitude) {
  std::vector<double> f(static_cast<size_t>(s.features));
  for (int64_t c = 0; c < s.features; ++c)
    f[static_cast<size_t>(c)] = s.map == Map::Given ? given->row(bh, r)[c] : feature(s, x.row(bh, r)[c]);
  if (magnitude)
    for (double& y : f) y = std::abs(y);
  return f;
}

// φ(k_j) of every visible key of item bh.
std::vector<std::vector<double>> key_features(const Setup& s, TensorView<const double> k,
                                              const HybridInputs<double>& in, int64_t bh, int64_t L, bool magnitude) {
  std::vector<std::vector<double>> out;
  for (int64_t j = 0; j < L; ++j) out.push_back(features(s, k, in.key_features, bh, j, magnitude));
  return out;
}

Row row(const Setup& s, TensorView<const double> q, TensorView<const double> k, const HybridInputs<double>& in,
        const std::vector<std::vector<double>>& fks, int64_t bh, int64_t i, int64_t L, bool magnitude) {
  const int64_t p = i + s.d.n_k - s.d.n_q, w = s.opts.window;
  const int64_t visible = s.opts.causal ? std::clamp<int64_t>(p + 1, 0, L) : L;
  const double gamma = s.gamma[static_cast<size_t>(bh % s.d.heads)];
  Row r;
  r.fq = features(s, q, in.query_features, bh, i, magnitude);
  std::vector<double> score(static_cast<size_t>(visible));
  double M = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    const bool win = w > 0 && (s.opts.causal ? j > p - w : std::abs(p - j) <= w);
    r.in_window.push_back(win);
    double dot = 0;
    for (int64_t t = 0; t < s.d.head_dim; ++t) dot += q.row(bh, i)[t] * k.row(bh, j)[t];
    score[static_cast<size_t>(j)] = s.scale * dot;
    if (win && score[static_cast<size_t>(j)] > M) M = score[static_cast<size_t>(j)], r.top = j;
  }
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
        } else {  // weight = φ(q_i)·φ(k_j)
          const std::vector<double>& fk = fks[static_cast<size_t>(key)];
          for (int64_t c = 0; c < s.features; ++c) {
            dfq_all.data()[(bh * d.n_q + i) * s.features + c] += dw * fk[static_cast<size_t>(c)];
            dfk_all.data()[(bh * d.n_k + key) * s.features + c] += dw * r.fq[static_cast<size_t>(c)];
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
  if (s.map == Map::Given) {
    g.params.emplace_back("query_features", std::move(dfq_all));
    g.params.emplace_back("key_features", std::move(dfk_all));
  } else {
    for (int64_t x = 0; x < q.size(); ++x) g.dq.data()[x] += dfq_all.data()[x] * feature_slope(s, q.data[x]);
    for (int64_t bh = 0; bh < d.bh(); ++bh)
      for (int64_t j = 0; j < mask.key_length(bh / d.heads) * d.head_dim; ++j) {
        const int64_t x = bh * d.n_k * d.head_dim + j;
        g.dk.data()[x] += dfk_all.data()[x] * feature_slope(s, k.data[x]);
      }
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

}  // namespace linattn::reference
