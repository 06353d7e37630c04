// Plain float64 softmax attention: build each row of scores, softmax it, multiply.
#include <cmath>
#include <limits>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/softmax/reference.h"
#include "linattn/softmax/args.h"
#include "linattn/reference_registry.h"

namespace linattn::reference {

SoftmaxAttentionResult<double> softmax_attention(TensorView<const double> q,
                                                 TensorView<const double> k,
                                                 TensorView<const double> v,
                                                 const AttentionOptions& opts) {
  const AttentionDims d = check_attention_args("reference::softmax_attention", q, k, v, opts);
  const double scale = resolve_scale("reference::softmax_attention", opts, d.head_dim);
  const KeyMask mask(d, opts);
  SoftmaxAttentionResult<double> r{Tensor<double>({d.batch, d.heads, d.n_q, d.value_dim}),
                                   Tensor<double>({d.batch, d.heads, d.n_q})};
  std::vector<double> s(static_cast<size_t>(d.n_k));
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.heads; ++h) {
      const int64_t bh = b * d.heads + h;
      for (int64_t i = 0; i < d.n_q; ++i) {
        const int64_t nvis = mask.visible(b, i);
        double* out = r.out.data() + (bh * d.n_q + i) * d.value_dim;
        double& lse = r.lse[bh * d.n_q + i];
        if (nvis == 0) {
          lse = -std::numeric_limits<double>::infinity();
          continue;
        }
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < nvis; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d.head_dim; ++c) dot += q.row(bh, i)[c] * k.row(bh, j)[c];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < nvis; ++j) sum += std::exp(s[j] - mx);
        for (int64_t j = 0; j < nvis; ++j) {
          const double p = std::exp(s[j] - mx) / sum;
          for (int64_t c = 0; c < d.value_dim; ++c) out[c] += p * v.row(bh, j)[c];
        }
        lse = mx + std::log(sum);
      }
    }
  return r;
}

AttentionGrads<double> softmax_attention_backward(TensorView<const double> q,
                                                  TensorView<const double> k,
                                                  TensorView<const double> v,
                                                  TensorView<const double> dout,
                                                  const AttentionOptions& opts) {
  const char* fn = "reference::softmax_attention_backward";
  const AttentionDims d = check_attention_args(fn, q, k, v, opts);
  check_same_shape_finite(fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  const double scale = resolve_scale(fn, opts, d.head_dim);
  const KeyMask mask(d, opts);
  const auto fwd = softmax_attention(q, k, v, opts);
  AttentionGrads<double> g{Tensor<double>(q.shape), Tensor<double>(k.shape),
                           Tensor<double>(v.shape), {}};
  std::vector<double> p(static_cast<size_t>(d.n_k)), dp(static_cast<size_t>(d.n_k));
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.heads; ++h) {
      const int64_t bh = b * d.heads + h;
      for (int64_t i = 0; i < d.n_q; ++i) {
        const int64_t nvis = mask.visible(b, i);
        const double lse = fwd.lse[bh * d.n_q + i];
        const double* go = dout.row(bh, i);
        // p_ij = exp(s_ij - lse_i); dp_ij = dout_i · v_j; ds_ij = p_ij (dp_ij - Σ_l p_il dp_il)
        double delta = 0;
        for (int64_t j = 0; j < nvis; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d.head_dim; ++c) dot += q.row(bh, i)[c] * k.row(bh, j)[c];
          p[j] = std::exp(dot * scale - lse);
          dp[j] = 0;
          for (int64_t c = 0; c < d.value_dim; ++c) dp[j] += go[c] * v.row(bh, j)[c];
          delta += p[j] * dp[j];
        }
        for (int64_t j = 0; j < nvis; ++j) {
          const double ds = p[j] * (dp[j] - delta);
          double* dq = g.dq.data() + (bh * d.n_q + i) * d.head_dim;
          double* dk = g.dk.data() + (bh * d.n_k + j) * d.head_dim;
          double* dv = g.dv.data() + (bh * d.n_k + j) * d.value_dim;
          for (int64_t c = 0; c < d.head_dim; ++c) {
            dq[c] += scale * ds * k.row(bh, j)[c];
            dk[c] += scale * ds * q.row(bh, i)[c];
          }
          for (int64_t c = 0; c < d.value_dim; ++c) dv[c] += p[j] * go[c];
        }
      }
    }
  return g;
}

}  // namespace linattn::reference

namespace linattn::reference {

ReferenceInfo reference_softmax() {
  ReferenceInfo r;
  r.forward = [](const MethodArgs<double>& a) {
    return softmax_attention(a.q, a.k, a.v, softmax_detail::options_from(a)).out;
  };
  r.backward = [](const MethodArgs<double>& a, TensorView<const double> dout) {
    return softmax_attention_backward(a.q, a.k, a.v, dout, softmax_detail::options_from(a));
  };
  return r;
}

}  // namespace linattn::reference
