#include "methods.h"

#include <algorithm>
#include <cmath>

#include "linattn/core/random.h"
#include "linattn/softmax/softmax_attention.h"

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
  return m;
}

Tensor<double> to_double(const Tensor<float>& x) {
  Tensor<double> y(x.shape());
  for (int64_t i = 0; i < x.size(); ++i) y[i] = x[i];
  return y;
}

}  // namespace

std::vector<Method> all_methods() { return {softmax_method(false), softmax_method(true)}; }

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
