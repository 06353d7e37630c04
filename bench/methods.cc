#include "methods.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <fstream>
#include <optional>
#include <stdexcept>

#include "linattn/core/random.h"
#include "linattn/random_features.h"
#include "linattn/efficient.h"
#include "linattn/kernelized.h"
#include "linattn/linformer.h"
#include "linattn/nystrom.h"
#include "linattn/softmax.h"
#include "linattn/softmax/reference.h"
#include "linattn/kernelized/reference.h"
#include "linattn/nystrom/reference.h"
#include "linattn/linformer/reference.h"
#include "linattn/efficient/reference.h"

namespace linattn::bench {

Inputs make_inputs(const Problem& p) {
  const Shape shape{p.batch, p.heads, p.n, p.head_dim};
  Inputs in{Tensor<float>(shape), Tensor<float>(shape), Tensor<float>(shape), Tensor<float>(shape)};
  fill_normal(in.q.data(), in.q.size(), p.seed);
  fill_normal(in.k.data(), in.k.size(), p.seed + 1);
  fill_normal(in.v.data(), in.v.size(), p.seed + 2);
  fill_normal(in.dout.data(), in.dout.size(), p.seed + 3);
  return in;
}

namespace {

void write_raw(const std::string& path, const Tensor<float>& t) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(sizeof(float) * t.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

// Visible (query, key) pairs per head: n² without a mask, n(n+1)/2 causal.
double score_pairs(const Problem& p, bool causal) {
  const double n = static_cast<double>(p.n);
  return causal ? n * (n + 1) / 2 : n * n;
}

Method softmax_method(bool causal) {
  Method m;
  m.name = causal ? "exact softmax (causal)" : "exact softmax";
  m.causal = causal;
  // Forward: two products per visible pair (q·k and p·v), 2 FLOPs per multiply-add.
  m.forward_flops = [causal](const Problem& p) {
    return 4.0 * p.head_dim * score_pairs(p, causal) * p.batch * p.heads;
  };
  // Backward: five products (recomputed S, dV, dP, dK, dQ): 2.5× the forward.
  m.backward_flops = [causal](const Problem& p) {
    return 10.0 * p.head_dim * score_pairs(p, causal) * p.batch * p.heads;
  };
  AttentionOptions opts;
  opts.causal = causal;
  m.forward = [opts](const Inputs& in) { return softmax_attention<float>(in.q, in.k, in.v, opts).out; };
  m.forward_backward = [opts](const Inputs& in) {
    const auto f = softmax_attention<float>(in.q, in.k, in.v, opts);
    const auto g = softmax_attention_backward<float>(in.q, in.k, in.v, in.dout, f.out, f.lse, opts);
    (void)g;
  };
  m.own_error = [m](const Inputs& in, const Tensor<float>& out, int64_t rows) {
    return error_vs_exact(m, in, out, rows);
  };
  return m;
}

Tensor<double> to_double(const Tensor<float>& x) {
  Tensor<double> y(x.shape());
  for (int64_t i = 0; i < x.size(); ++i) y[i] = x[i];
  return y;
}

// Rows of head bh of a [B,H,n,D] tensor as an [n, D] float64 matrix.
Tensor<double> head_rows(const Tensor<float>& x, int64_t bh) {
  const int64_t n = x.dim(2), D = x.dim(3);
  Tensor<double> y({n, D});
  for (int64_t i = 0; i < n * D; ++i) y[i] = x[bh * n * D + i];
  return y;
}

// Sampled rows of kernelized attention from the float64 reference features:
// out_i = Σ_j (φq_i·φk_j) v_j / (Σ_j φq_i·φk_j + eps) over j < n (or j <= i causal).
double kernelized_own_error(const Inputs& in, const Tensor<float>& out, int64_t sample_rows,
                            const std::string& name, const Tensor<double>* w, bool causal,
                            double eps) {
  const int64_t BH = in.q.dim(0) * in.q.dim(1), n = in.q.dim(2), dv = in.v.dim(3);
  const double scale = 1 / std::sqrt(double(in.q.dim(3)));
  double max_err = 0, max_ref = 0;
  for (int64_t bh = 0; bh < BH; ++bh) {
    std::optional<TensorView<const double>> proj;
    if (w) proj = w->view();
    const auto fq = reference::features(head_rows(in.q, bh), name, proj, scale);
    const auto fk = reference::features(head_rows(in.k, bh), name, proj, scale);
    const int64_t m = fq.dim(1), rows = std::min(sample_rows, n);
    for (int64_t s = 0; s < rows; ++s) {
      const int64_t i = s * n / rows, nvis = causal ? i + 1 : n;
      std::vector<double> num(dv, 0.0);
      double den = eps;
      for (int64_t j = 0; j < nvis; ++j) {
        double a = 0;
        for (int64_t r = 0; r < m; ++r) a += fq[i * m + r] * fk[j * m + r];
        den += a;
        for (int64_t c = 0; c < dv; ++c) num[c] += a * in.v.view().row(bh, j)[c];
      }
      for (int64_t c = 0; c < dv; ++c) {
        const double ref = den != 0 ? num[c] / den : 0.0;
        max_err = std::max(max_err, std::abs(out.view().row(bh, i)[c] - ref));
        max_ref = std::max(max_ref, std::abs(ref));
      }
    }
  }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

Method linear_method(const std::string& map, bool causal) {
  Method m;
  m.name = "linear " + map + (causal ? " (causal)" : "");
  m.causal = causal;
  // φ(q)·KV and KV = φ(k)ᵀV (2·n·d·d_v each) plus the normaliser; the convention
  // 4·n·m·(d + d_v) with m = d counts the feature products FAVOR has and this map has not.
  m.forward_flops = [](const Problem& p) {
    return 4.0 * p.n * p.head_dim * (p.head_dim + p.head_dim) * p.batch * p.heads;
  };
  m.backward_flops = [m](const Problem& p) { return 2 * m.forward_flops(p); };
  LinearAttentionOptions o;
  o.feature_map = map;
  o.causal = causal;
  m.forward = [o](const Inputs& in) { return linear_attention<float>(in.q, in.k, in.v, o); };
  m.forward_backward = [o](const Inputs& in) {
    (void)linear_attention<float>(in.q, in.k, in.v, o);
    (void)linear_attention_backward<float>(in.q, in.k, in.v, in.dout, o);
  };
  m.own_error = [map, causal, o](const Inputs& in, const Tensor<float>& out, int64_t rows) {
    return kernelized_own_error(in, out, rows, map, nullptr, causal, o.eps);
  };
  return m;
}

Method favor_method(int64_t features, bool causal) {
  Method m;
  m.name = "favor+ m=" + std::to_string(features) + (causal ? " (causal)" : "");
  m.causal = causal;
  // Per head: φ(q), φ(k) (2·n·m·d each), KV and φ(q)·KV (2·n·m·d_v each): 4·n·m·(d + d_v).
  m.forward_flops = [features](const Problem& p) {
    return 4.0 * p.n * features * (p.head_dim + p.head_dim) * p.batch * p.heads;
  };
  m.backward_flops = [m](const Problem& p) { return 2 * m.forward_flops(p); };
  auto w = std::make_shared<Tensor<float>>();
  auto wd = std::make_shared<Tensor<double>>();
  FavorOptions o;
  o.causal = causal;
  auto projection = [w, wd, features](int64_t d) {
    if (w->size() == 0 || w->dim(1) != d) {
      *w = random_features<float>(features, d, FeatureKind::Orthogonal, 42);
      *wd = Tensor<double>(w->shape());
      for (int64_t i = 0; i < w->size(); ++i) (*wd)[i] = (*w)[i];
    }
    return w;
  };
  m.forward = [o, projection](const Inputs& in) {
    return favor_attention<float>(in.q, in.k, in.v, *projection(in.q.dim(3)), o);
  };
  m.forward_backward = [o, projection](const Inputs& in) {
    const auto& pw = *projection(in.q.dim(3));
    (void)favor_attention<float>(in.q, in.k, in.v, pw, o);
    (void)favor_attention_backward<float>(in.q, in.k, in.v, pw, in.dout, o);
  };
  m.own_error = [projection, wd, causal](const Inputs& in, const Tensor<float>& out, int64_t rows) {
    projection(in.q.dim(3));
    return kernelized_own_error(in, out, rows, "positive", wd.get(), causal, 0.0);
  };
  m.write_parameters = [projection, features](const Problem& p, const std::string& dir) {
    write_raw(dir + "/favor_w_" + std::to_string(features) + ".f32", *projection(p.head_dim));
  };
  return m;
}


// Largest |out − ref| / max|ref| over sampled rows of every (batch, head) of [B,H,n,d_v] tensors.
double sampled_error(const Tensor<float>& out, const Tensor<double>& ref, int64_t sample_rows) {
  const int64_t BH = out.dim(0) * out.dim(1), n = out.dim(2), dv = out.dim(3),
                rows = std::min(sample_rows, n);
  double max_err = 0, max_ref = 0;
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t s = 0; s < rows; ++s) {
      const int64_t i = s * n / rows;
      for (int64_t c = 0; c < dv; ++c) {
        const double r = ref[(bh * n + i) * dv + c];
        max_err = std::max(max_err, std::abs(out.view().row(bh, i)[c] - r));
        max_ref = std::max(max_ref, std::abs(r));
      }
    }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

Method nystrom_method(int64_t landmarks) {
  Method m;
  m.name = "nystrom m=" + std::to_string(landmarks);
  NystromOptions o;
  o.num_landmarks = landmarks;
  // Per head, with m landmarks and T pinv iterations: softmax(QK̃ᵀ)·Y and softmax(Q̃Kᵀ)·V
  // (2·n·m·d + 2·n·m·d_v each), the m×m kernel and Y = Z·W (2m²(d + d_v)), and four m×m
  // products (2m³ each) per iteration.
  m.forward_flops = [o](const Problem& p) {
    const double n = p.n, mm = std::min<int64_t>(o.num_landmarks, p.n), d = p.head_dim;
    return (4 * n * mm * (d + d) + 2 * mm * mm * (d + d) + 8.0 * o.pinv_iterations * mm * mm * mm) *
           p.batch * p.heads;
  };
  // The backward's products (backward.cc): n·m·(12d + 10d_v) for the recomputed and adjoint
  // products over the sequence, 22 m×m products per pinv iteration, and the m×m terms.
  m.backward_flops = [o](const Problem& p) {
    const double n = p.n, mm = std::min<int64_t>(o.num_landmarks, p.n), d = p.head_dim;
    return (n * mm * (12 * d + 10 * d) + 8 * mm * mm * (d + d) + 22.0 * o.pinv_iterations * mm * mm * mm) *
           p.batch * p.heads;
  };
  m.forward = [o](const Inputs& in) { return nystrom_attention<float>(in.q, in.k, in.v, o); };
  m.forward_backward = [o](const Inputs& in) {
    (void)nystrom_attention<float>(in.q, in.k, in.v, o);
    (void)nystrom_attention_backward<float>(in.q, in.k, in.v, in.dout, o);
  };
  m.own_error = [o](const Inputs& in, const Tensor<float>& out, int64_t rows) {
    const auto ref = reference::nystrom_attention(to_double(in.q), to_double(in.k), to_double(in.v), o,
                                                  std::nullopt);
    return sampled_error(out, ref.value, rows);
  };
  return m;
}

Method linformer_method(int64_t s_proj) {
  Method m;
  m.name = "linformer s=" + std::to_string(s_proj);
  // Per head: K' = E·K, V' = F·V, Q·K'ᵀ and P·V': 4·n·s·(d + d_v).
  m.forward_flops = [s_proj](const Problem& p) {
    return 4.0 * p.n * s_proj * (p.head_dim + p.head_dim) * p.batch * p.heads;
  };
  // Backward (linformer.cc): n·s·(12d + 10d_v).
  m.backward_flops = [s_proj](const Problem& p) {
    return 1.0 * p.n * s_proj * (12 * p.head_dim + 10 * p.head_dim) * p.batch * p.heads;
  };
  // E, F [s, n] shared by heads, as linformer_projections draws them, for the current n.
  auto ef = std::make_shared<std::pair<Tensor<float>, Tensor<float>>>();
  auto projections = [ef, s_proj](int64_t n) {
    if (ef->first.size() == 0 || ef->first.dim(1) != n) *ef = linformer_projections<float>(s_proj, n, 0, 42);
    return ef;
  };
  m.forward = [projections](const Inputs& in) {
    const auto ef = projections(in.k.dim(2));
    return linformer_attention<float>(in.q, in.k, in.v, ef->first, ef->second);
  };
  m.forward_backward = [projections](const Inputs& in) {
    const auto ef = projections(in.k.dim(2));
    (void)linformer_attention<float>(in.q, in.k, in.v, ef->first, ef->second);
    (void)linformer_attention_backward<float>(in.q, in.k, in.v, ef->first, ef->second, in.dout);
  };
  m.own_error = [projections](const Inputs& in, const Tensor<float>& out, int64_t rows) {
    const auto ef = projections(in.k.dim(2));
    const auto ref = reference::linformer_attention(to_double(in.q), to_double(in.k), to_double(in.v),
                                                    to_double(ef->first), to_double(ef->second), {});
    return sampled_error(out, ref.value, rows);
  };
  m.write_parameters = [projections, s_proj](const Problem& p, const std::string& dir) {
    const auto ef = projections(p.n);
    write_raw(dir + "/linformer_" + std::to_string(s_proj) + "_e.f32", ef->first);
    write_raw(dir + "/linformer_" + std::to_string(s_proj) + "_f.f32", ef->second);
  };
  return m;
}

Method efficient_method() {
  Method m;
  m.name = "efficient attention";
  // Per head: G = ρ_kᵀV and ρ_q·G, 2·n·d·d_v each.
  m.forward_flops = [](const Problem& p) {
    return 4.0 * p.n * p.head_dim * p.head_dim * p.batch * p.heads;
  };
  // Backward (efficient.cc): five n·d·d_v products.
  m.backward_flops = [](const Problem& p) {
    return 10.0 * p.n * p.head_dim * p.head_dim * p.batch * p.heads;
  };
  m.forward = [](const Inputs& in) { return efficient_attention<float>(in.q, in.k, in.v); };
  m.forward_backward = [](const Inputs& in) {
    (void)efficient_attention<float>(in.q, in.k, in.v);
    (void)efficient_attention_backward<float>(in.q, in.k, in.v, in.dout);
  };
  m.own_error = [](const Inputs& in, const Tensor<float>& out, int64_t rows) {
    const auto ref = reference::efficient_attention(to_double(in.q), to_double(in.k), to_double(in.v), {});
    return sampled_error(out, ref.value, rows);
  };
  return m;
}

}  // namespace

std::vector<Method> all_methods(const MethodSizes& z) {
  return {softmax_method(false),
          softmax_method(true),
          linear_method("elu", false),
          linear_method("elu", true),
          favor_method(z.favor_features, false),
          favor_method(z.favor_features, true),
          nystrom_method(z.landmarks),
          linformer_method(z.linformer_proj),
          efficient_method()};
}

double error_vs_exact(const Method& m, const Inputs& in, const Tensor<float>& out,
                      int64_t sample_rows) {
  const int64_t B = in.q.dim(0), H = in.q.dim(1), n = in.q.dim(2), d = in.q.dim(3);
  const int64_t dv = in.v.dim(3);
  const Tensor<double> k = to_double(in.k), v = to_double(in.v);
  double max_err = 0, max_ref = 0;
  for (int64_t s = 0; s < std::min(sample_rows, n); ++s) {
    const int64_t i = s * n / std::min(sample_rows, n);
    // Row i alone over its visible keys: n_q = 1 against keys [0, i] (causal) or all.
    Tensor<double> qi({B, H, 1, d});
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t c = 0; c < d; ++c) qi[bh * d + c] = in.q.view().row(bh, i)[c];
    AttentionOptions opts;
    if (m.causal) opts.key_lengths = std::vector<int64_t>(static_cast<size_t>(B), i + 1);
    const auto ref = reference::softmax_attention(qi, k, v, opts);
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t c = 0; c < dv; ++c) {
        const double r = ref.out[bh * dv + c];
        max_err = std::max(max_err, std::abs(out.view().row(bh, i)[c] - r));
        max_ref = std::max(max_ref, std::abs(r));
      }
  }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

}  // namespace linattn::bench
