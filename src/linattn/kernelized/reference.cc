// Plain float64 kernelized attention: features by their textbook (unstabilised) formulas, the
// full matrix A_ij = φ(q_i)·φ(k_j), and explicit Jacobians of the feature maps for the
// backward. Independent of the fast path's code.
#include <cmath>
#include <functional>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/kernelized/reference.h"
#include "linattn/kernelized/args.h"
#include "linattn/reference_registry.h"

namespace linattn::reference {
namespace {

using Row = std::vector<double>;
using Matrix = std::vector<Row>;

// φ(x) and its Jacobian J[r][c] = ∂φ_r/∂x_c for one row.
struct FeatureRow {
  Row phi;
  Matrix jac;
};
using FeatureFn = std::function<FeatureRow(const double* x)>;

FeatureFn plain_feature(const std::string& name, int64_t d, double p) {
  if (name == "given" || name == kFormerGivenName) {
    return [=](const double* x) {
      FeatureRow f{Row(x, x + d), Matrix(d, Row(d, 0.0))};
      for (int64_t c = 0; c < d; ++c) f.jac[c][c] = 1;
      return f;
    };
  }
  if (name == "elu" || name == "relu") {
    const bool elu = name == "elu";
    return [=](const double* x) {
      FeatureRow f{Row(d), Matrix(d, Row(d, 0.0))};
      for (int64_t c = 0; c < d; ++c) {
        if (x[c] > 0) {
          f.phi[c] = elu ? x[c] + 1 : x[c];
          f.jac[c][c] = 1;
        } else {
          f.phi[c] = elu ? std::exp(x[c]) : 0;
          f.jac[c][c] = elu ? std::exp(x[c]) : 0;
        }
      }
      return f;
    };
  }
  // focused: φ = R·a/A, r = relu(x), a = rᵖ, R = ‖r‖, A = ‖a‖
  return [=](const double* x) {
    FeatureRow f{Row(d, 0.0), Matrix(d, Row(d, 0.0))};
    Row r(d), a(d);
    double R2 = 0, A2 = 0;
    for (int64_t c = 0; c < d; ++c) {
      r[c] = std::max(x[c], 0.0);
      a[c] = r[c] > 0 ? std::pow(r[c], p) : 0;
      R2 += r[c] * r[c];
      A2 += a[c] * a[c];
    }
    if (A2 == 0) return f;
    const double R = std::sqrt(R2), A = std::sqrt(A2);
    for (int64_t i = 0; i < d; ++i) f.phi[i] = R * a[i] / A;
    for (int64_t i = 0; i < d; ++i)
      for (int64_t c = 0; c < d; ++c) {
        if (x[c] <= 0) continue;
        const double da_c = p * std::pow(r[c], p - 1);  // ∂a_c/∂x_c
        f.jac[i][c] = (r[c] / R) * a[i] / A + (i == c ? R * da_c / A : 0.0) -
                      R * a[i] * a[c] * da_c / (A * A * A);
      }
    return f;
  };
}

FeatureFn favor_feature(const std::string& kernel, TensorView<const double> w, double scale) {
  const int64_t m = w.dim(0), d = w.dim(1);
  const double s = std::sqrt(scale);
  return [=](const double* x) {
    Row xt(d), u(m);
    double h = 0;
    for (int64_t c = 0; c < d; ++c) {
      xt[c] = s * x[c];
      h += 0.5 * xt[c] * xt[c];
    }
    for (int64_t r = 0; r < m; ++r) {
      u[r] = 0;
      for (int64_t c = 0; c < d; ++c) u[r] += w.data[r * d + c] * xt[c];
    }
    FeatureRow f;
    if (kernel == "positive") {
      f = {Row(m), Matrix(m, Row(d))};
      for (int64_t r = 0; r < m; ++r) {
        f.phi[r] = std::exp(u[r] - h) / std::sqrt(double(m));
        for (int64_t c = 0; c < d; ++c) f.jac[r][c] = s * f.phi[r] * (w.data[r * d + c] - xt[c]);
      }
    } else if (kernel == "hyperbolic") {
      f = {Row(2 * m), Matrix(2 * m, Row(d))};
      for (int64_t r = 0; r < m; ++r) {
        f.phi[r] = std::exp(u[r] - h) / std::sqrt(2.0 * m);
        f.phi[m + r] = std::exp(-u[r] - h) / std::sqrt(2.0 * m);
        for (int64_t c = 0; c < d; ++c) {
          f.jac[r][c] = s * f.phi[r] * (w.data[r * d + c] - xt[c]);
          f.jac[m + r][c] = s * f.phi[m + r] * (-w.data[r * d + c] - xt[c]);
        }
      }
    } else {
      f = {Row(2 * m), Matrix(2 * m, Row(d))};
      const double amp = std::exp(h) / std::sqrt(double(m));
      for (int64_t r = 0; r < m; ++r) {
        f.phi[r] = amp * std::sin(u[r]);
        f.phi[m + r] = amp * std::cos(u[r]);
        for (int64_t c = 0; c < d; ++c) {
          f.jac[r][c] = s * (f.phi[r] * xt[c] + amp * std::cos(u[r]) * w.data[r * d + c]);
          f.jac[m + r][c] = s * (f.phi[m + r] * xt[c] - amp * std::sin(u[r]) * w.data[r * d + c]);
        }
      }
    }
    return f;
  };
}

struct Problem {
  TensorView<const double> q, k, v;
  AttentionDims d;
  AttentionOptions mask_opts;
  FeatureFn feature;
  double eps;
};

// out (and, given dout, gradients) for every (b, h), from A_ij = φ(q_i)·φ(k_j).
void run(const Problem& p, const double* dout, double* out, double* dq, double* dk, double* dv) {
  const AttentionDims& d = p.d;
  const KeyMask mask(d, p.mask_opts);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.heads; ++h) {
      const int64_t bh = b * d.heads + h;
      std::vector<FeatureRow> fq, fk;
      for (int64_t i = 0; i < d.n_q; ++i) fq.push_back(p.feature(p.q.row(bh, i)));
      for (int64_t j = 0; j < d.n_k; ++j) fk.push_back(p.feature(p.k.row(bh, j)));
      const size_t m = fq.empty() ? 0 : fq[0].phi.size();
      Matrix dphik(d.n_k, Row(m, 0.0));
      for (int64_t i = 0; i < d.n_q; ++i) {
        const int64_t nvis = mask.visible(b, i);
        Row A(nvis, 0.0);
        double D = p.eps;
        for (int64_t j = 0; j < nvis; ++j) {
          for (size_t r = 0; r < m; ++r) A[j] += fq[i].phi[r] * fk[j].phi[r];
          D += A[j];
        }
        double* o = out + (bh * d.n_q + i) * d.value_dim;
        if (D == 0) continue;  // out_i = 0, no gradient
        for (int64_t j = 0; j < nvis; ++j)
          for (int64_t c = 0; c < d.value_dim; ++c) o[c] += A[j] * p.v.row(bh, j)[c] / D;
        if (!dout) continue;
        // out_i = Σ_j A_ij v_j / D_i  ⇒  dA_ij = (g_i·v_j − g_i·out_i)/D_i, dv_j += A_ij g_i/D_i
        const double* g = dout + (bh * d.n_q + i) * d.value_dim;
        double g_out = 0;
        for (int64_t c = 0; c < d.value_dim; ++c) g_out += g[c] * o[c];
        Row dphiq(m, 0.0);
        for (int64_t j = 0; j < nvis; ++j) {
          double g_v = 0;
          for (int64_t c = 0; c < d.value_dim; ++c) {
            g_v += g[c] * p.v.row(bh, j)[c];
            dv[(bh * d.n_k + j) * d.value_dim + c] += A[j] * g[c] / D;
          }
          const double dA = (g_v - g_out) / D;
          for (size_t r = 0; r < m; ++r) {  // A_ij = φq_i·φk_j
            dphiq[r] += dA * fk[j].phi[r];
            dphik[j][r] += dA * fq[i].phi[r];
          }
        }
        for (int64_t c = 0; c < d.head_dim; ++c)
          for (size_t r = 0; r < m; ++r)
            dq[(bh * d.n_q + i) * d.head_dim + c] += fq[i].jac[r][c] * dphiq[r];
      }
      if (!dout) continue;
      for (int64_t j = 0; j < d.n_k; ++j)
        for (int64_t c = 0; c < d.head_dim; ++c)
          for (size_t r = 0; r < m; ++r)
            dk[(bh * d.n_k + j) * d.head_dim + c] += fk[j].jac[r][c] * dphik[j][r];
    }
}

// out[i] += Σ_t w[h,t]·v[i+t−off]; and its gradients.
void dwc(const Problem& p, TensorView<const double> w, const double* dout, double* out,
         double* dv, double* dw) {
  const AttentionDims& d = p.d;
  const KeyMask mask(d, p.mask_opts);
  const int64_t K = w.dim(1), off = p.mask_opts.causal ? K - 1 : (K - 1) / 2;
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.heads; ++h) {
      const int64_t bh = b * d.heads + h;
      for (int64_t i = 0; i < d.n_q; ++i)
        for (int64_t t = 0; t < K; ++t) {
          const int64_t j = i + t - off;
          if (j < 0 || j >= mask.key_length(b)) continue;
          for (int64_t c = 0; c < d.value_dim; ++c) {
            const double vjc = p.v.row(bh, j)[c];
            out[(bh * d.n_q + i) * d.value_dim + c] += w.data[h * K + t] * vjc;
            if (dout) {
              const double g = dout[(bh * d.n_q + i) * d.value_dim + c];
              dv[(bh * d.n_k + j) * d.value_dim + c] += w.data[h * K + t] * g;
              dw[h * K + t] += g * vjc;
            }
          }
        }
    }
}

Problem linear_problem(TensorView<const double> q, TensorView<const double> k,
                       TensorView<const double> v, const LinearAttentionOptions& o) {
  AttentionOptions mo;
  mo.causal = o.causal;
  mo.key_lengths = o.key_lengths;
  const AttentionDims d = check_attention_args("reference::linear_attention", q, k, v, mo);
  return {q, k, v, d, mo, plain_feature(o.feature_map, d.head_dim, o.focus_power), o.eps};
}

Problem favor_problem(TensorView<const double> q, TensorView<const double> k,
                      TensorView<const double> v, TensorView<const double> w, const FavorOptions& o) {
  AttentionOptions mo;
  mo.causal = o.causal;
  mo.key_lengths = o.key_lengths;
  const AttentionDims d = check_attention_args("reference::favor_attention", q, k, v, mo);
  const double scale = o.scale ? *o.scale : 1 / std::sqrt(double(d.head_dim));
  return {q, k, v, d, mo, favor_feature(o.kernel, w, scale), 0.0};
}

}  // namespace

Tensor<double> linear_attention(TensorView<const double> q, TensorView<const double> k,
                                TensorView<const double> v, const LinearAttentionOptions& o,
                                std::optional<TensorView<const double>> conv_weight) {
  const Problem p = linear_problem(q, k, v, o);
  Tensor<double> out({p.d.batch, p.d.heads, p.d.n_q, p.d.value_dim});
  run(p, nullptr, out.data(), nullptr, nullptr, nullptr);
  if (conv_weight) dwc(p, *conv_weight, nullptr, out.data(), nullptr, nullptr);
  return out;
}

AttentionGrads<double> linear_attention_backward(TensorView<const double> q,
                                                  TensorView<const double> k,
                                                  TensorView<const double> v,
                                                  TensorView<const double> dout,
                                                  const LinearAttentionOptions& o,
                                                  std::optional<TensorView<const double>> conv_weight) {
  const Problem p = linear_problem(q, k, v, o);
  Tensor<double> out({p.d.batch, p.d.heads, p.d.n_q, p.d.value_dim});
  AttentionGrads<double> g{Tensor<double>(q.shape), Tensor<double>(k.shape),
                           Tensor<double>(v.shape), {}};
  run(p, dout.data, out.data(), g.dq.data(), g.dk.data(), g.dv.data());
  if (conv_weight) {
    Tensor<double> dw(conv_weight->shape);
    dwc(p, *conv_weight, dout.data, out.data(), g.dv.data(), dw.data());
    g.params.emplace_back("conv_weight", std::move(dw));
  }
  return g;
}

Tensor<double> favor_attention(TensorView<const double> q, TensorView<const double> k,
                               TensorView<const double> v, TensorView<const double> w,
                               const FavorOptions& o) {
  const Problem p = favor_problem(q, k, v, w, o);
  Tensor<double> out({p.d.batch, p.d.heads, p.d.n_q, p.d.value_dim});
  run(p, nullptr, out.data(), nullptr, nullptr, nullptr);
  return out;
}

AttentionGrads<double> favor_attention_backward(TensorView<const double> q,
                                                TensorView<const double> k,
                                                TensorView<const double> v,
                                                TensorView<const double> w,
                                                TensorView<const double> dout, const FavorOptions& o) {
  const Problem p = favor_problem(q, k, v, w, o);
  Tensor<double> out({p.d.batch, p.d.heads, p.d.n_q, p.d.value_dim});
  AttentionGrads<double> g{Tensor<double>(q.shape), Tensor<double>(k.shape), Tensor<double>(v.shape), {}};
  run(p, dout.data, out.data(), g.dq.data(), g.dk.data(), g.dv.data());
  return g;
}

Tensor<double> features(TensorView<const double> x, const std::string& name,
                        std::optional<TensorView<const double>> projection, double scale,
                        double focus_power, Tensor<double>* jacobian) {
  require(x.rank() == 2, "reference::features: x must be [n, d]");
  const int64_t n = x.dim(0), d = x.dim(1);
  const FeatureFn f = projection ? favor_feature(name, *projection, scale)
                                 : plain_feature(name, d, focus_power);
  Tensor<double> out;
  for (int64_t i = 0; i < n; ++i) {
    const FeatureRow row = f(x.data + i * d);
    const auto m = static_cast<int64_t>(row.phi.size());
    if (i == 0) {
      out = Tensor<double>({n, m});
      if (jacobian) *jacobian = Tensor<double>({n, m, d});
    }
    for (int64_t r = 0; r < m; ++r) {
      out[i * m + r] = row.phi[r];
      if (jacobian)
        for (int64_t c = 0; c < d; ++c) (*jacobian)[(i * m + r) * d + c] = row.jac[r][c];
    }
  }
  return out;
}

Tensor<double> hedgehog_features(TensorView<const double> x, TensorView<const double> weight,
                                 TensorView<const double> bias) {
  require(x.rank() == 4 && weight.rank() == 3 && bias.rank() == 2, "reference::hedgehog_features: shapes");
  const int64_t B = x.dim(0), H = x.dim(1), n = x.dim(2), d = x.dim(3), f = weight.dim(2);
  Tensor<double> out({B, H, n, 2 * f});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const double* xi = x.data + ((b * H + h) * n + i) * d;
        double* o = out.data() + ((b * H + h) * n + i) * 2 * f;
        Row u(f);
        for (int64_t j = 0; j < f; ++j) {
          u[j] = bias.data[h * f + j];
          for (int64_t c = 0; c < d; ++c) u[j] += xi[c] * weight.data[(h * d + c) * f + j];
        }
        // The textbook softmax of u and of −u, unshifted.
        double plus = 0, minus = 0;
        for (int64_t j = 0; j < f; ++j) {
          plus += std::exp(u[j]);
          minus += std::exp(-u[j]);
        }
        for (int64_t j = 0; j < f; ++j) {
          o[j] = std::exp(u[j]) / plus;
          o[f + j] = std::exp(-u[j]) / minus;
        }
      }
  return out;
}

}  // namespace linattn::reference

namespace linattn::reference {

ReferenceInfo reference_linear() {
  ReferenceInfo r;
  r.forward = [](const MethodArgs<double>& a) {
    const auto c = kernelized::linear_call(a);
    return linear_attention(a.q, a.k, a.v, c.opts, c.conv_weight);
  };
  r.backward = [](const MethodArgs<double>& a, TensorView<const double> dout) {
    const auto c = kernelized::linear_call(a);
    return linear_attention_backward(a.q, a.k, a.v, dout, c.opts, c.conv_weight);
  };
  return r;
}

ReferenceInfo reference_favor() {
  ReferenceInfo r;
  r.forward = [](const MethodArgs<double>& a) {
    const auto c = kernelized::favor_call(a);
    return favor_attention(a.q, a.k, a.v, c.projection, c.opts);
  };
  r.backward = [](const MethodArgs<double>& a, TensorView<const double> dout) {
    const auto c = kernelized::favor_call(a);
    return favor_attention_backward(a.q, a.k, a.v, c.projection, dout, c.opts);
  };
  return r;
}

}  // namespace linattn::reference
