#include "linattn/core/attention_args.h"
#include "linattn/efficient/reference.h"
#include "linattn/efficient/args.h"
#include "linattn/reference_registry.h"
// Efficient Attention in plain float64 loops with rounding bounds (tracked_matrix.h), in the
// fast path's association.
#include "linattn/core/tracked_matrix.h"
#include "linattn/efficient/internal.h"

namespace linattn::reference {
namespace {

struct Head {
  Tracked Q, V, rho_kt, G, rho_q;
};

Head head(const Arith& a, const efficient::Setup& s, TensorView<const double> q,
          TensorView<const double> k, TensorView<const double> v, int64_t bh, int64_t L) {
  const AttentionDims& d = s.d;
  Head x;
  x.Q = input(q.row(bh, 0), d.n_q, d.head_dim, d.head_dim);
  x.V = input(v.row(bh, 0), L, d.value_dim, d.value_dim);
  x.rho_kt = softmax_rows(a, scale(a, transpose(input(k.row(bh, 0), L, d.head_dim, d.head_dim)), s.scale));
  x.G = matmul(a, x.rho_kt, false, x.V, false);
  x.rho_q = softmax_rows(a, scale(a, x.Q, s.scale));
  return x;
}

}  // namespace

Bounded efficient_attention(TensorView<const double> q, TensorView<const double> k,
                            TensorView<const double> v, const EfficientAttentionOptions& opts,
                            double u) {
  const Arith a{u};
  const efficient::Setup s = efficient::check_args("reference::efficient_attention", q, k, v, opts);
  const KeyMask mask(s.d, s.mask_opts);
  Bounded out = zero_bounded({s.d.batch, s.d.heads, s.d.n_q, s.d.value_dim});
  for (int64_t bh = 0; bh < s.d.bh(); ++bh) {
    const int64_t L = mask.key_length(bh / s.d.heads);
    if (L == 0) continue;
    const Head x = head(a, s, q, k, v, bh, L);
    store_head(matmul(a, x.rho_q, false, x.G, false), out, bh);
  }
  return out;
}

std::vector<Bounded> efficient_attention_backward(TensorView<const double> q,
                                                  TensorView<const double> k,
                                                  TensorView<const double> v,
                                                  TensorView<const double> dout,
                                                  const EfficientAttentionOptions& opts, double u) {
  const Arith a{u};
  const efficient::Setup s =
      efficient::check_args("reference::efficient_attention_backward", q, k, v, opts);
  const AttentionDims& d = s.d;
  const KeyMask mask(d, s.mask_opts);
  Bounded dq = zero_bounded(q.shape), dk = zero_bounded(k.shape), dv = zero_bounded(v.shape);
  for (int64_t bh = 0; bh < d.bh(); ++bh) {
    const int64_t L = mask.key_length(bh / d.heads);
    if (L == 0) continue;
    const Head x = head(a, s, q, k, v, bh, L);
    const Tracked G = input(dout.row(bh, 0), d.n_q, d.value_dim, d.value_dim);
    const Tracked dG = matmul(a, x.rho_q, true, G, false);
    store_head(scale(a, softmax_rows_backward(a, x.rho_q, matmul(a, G, false, x.G, true)), s.scale), dq,
               bh);
    const Tracked dSk = softmax_rows_backward(a, x.rho_kt, matmul(a, dG, false, x.V, true));
    store_head(transpose(scale(a, dSk, s.scale)), dk, bh);
    store_head(matmul(a, x.rho_kt, true, dG, false), dv, bh);
  }
  std::vector<Bounded> grads;
  for (Bounded* g : {&dq, &dk, &dv}) grads.push_back(std::move(*g));
  return grads;
}

}  // namespace linattn::reference

namespace linattn::reference {

ReferenceInfo reference_efficient() {
  ReferenceInfo r;
  r.forward = [](const MethodArgs<double>& a) {
    return efficient_attention(a.q, a.k, a.v, efficient::options_from(a)).value;
  };
  r.backward = [](const MethodArgs<double>& a, TensorView<const double> dout) {
    auto b = efficient_attention_backward(a.q, a.k, a.v, dout, efficient::options_from(a));
    return AttentionGrads<double>{std::move(b[0].value), std::move(b[1].value), std::move(b[2].value), {}};
  };
  return r;
}

}  // namespace linattn::reference
