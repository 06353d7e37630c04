#include "linattn/core/attention_args.h"
#include "linattn/linformer/reference.h"
#include "linattn/linformer/args.h"
#include "linattn/reference_registry.h"
// Linformer in plain float64 loops with rounding bounds (tracked_matrix.h), in the fast path's
// association.
#include "linattn/core/tracked_matrix.h"
#include "linattn/linformer/internal.h"

namespace linattn::reference {
namespace {

struct Head {
  Tracked Q, K, V, E, F, Kp, Vp, P;
};

Head head(const Arith& a, const linformer::Setup& s, TensorView<const double> q,
          TensorView<const double> k, TensorView<const double> v, TensorView<const double> e,
          TensorView<const double> f, int64_t bh, int64_t L) {
  const AttentionDims& d = s.d;
  const int64_t h = bh % d.heads;
  Head x;
  x.Q = input(q.row(bh, 0), d.n_q, d.head_dim, d.head_dim);
  x.K = input(k.row(bh, 0), L, d.head_dim, d.head_dim);
  x.V = input(v.row(bh, 0), L, d.value_dim, d.value_dim);
  x.E = input(e.data + s.offset(h), s.s_proj, L, s.n_max);
  x.F = input(f.data + s.offset(h), s.s_proj, L, s.n_max);
  x.Kp = matmul(a, x.E, false, x.K, false);
  x.Vp = matmul(a, x.F, false, x.V, false);
  x.P = softmax_rows(a, matmul(a, x.Q, false, x.Kp, true, s.scale));
  return x;
}

// r[offset..] += x (a BLAS product accumulated with beta = 1): one more rounding per element.
void accumulate(const Arith& a, const Tracked& x, Bounded& r, int64_t offset, int64_t ld) {
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t j = 0; j < x.cols; ++j) {
      double& val = r.value[offset + i * ld + j];
      r.bound[offset + i * ld + j] += x.e(i, j) + a.u * (std::abs(val) + std::abs(x.v(i, j)));
      val += x.v(i, j);
    }
}

}  // namespace

Bounded linformer_attention(TensorView<const double> q, TensorView<const double> k,
                            TensorView<const double> v, TensorView<const double> e,
                            TensorView<const double> f, const LinformerOptions& opts, double u) {
  const Arith a{u};
  const linformer::Setup s = linformer::check_args("reference::linformer_attention", q, k, v, e, f, opts);
  const AttentionDims& d = s.d;
  const KeyMask mask(d, s.mask_opts);
  Bounded out = zero_bounded({d.batch, d.heads, d.n_q, d.value_dim});
  for (int64_t bh = 0; bh < d.bh(); ++bh) {
    const Head x = head(a, s, q, k, v, e, f, bh, mask.key_length(bh / d.heads));
    store(matmul(a, x.P, false, x.Vp, false), out, bh * d.n_q * d.value_dim, d.value_dim);
  }
  return out;
}

std::vector<Bounded> linformer_attention_backward(TensorView<const double> q,
                                                  TensorView<const double> k,
                                                  TensorView<const double> v,
                                                  TensorView<const double> e,
                                                  TensorView<const double> f,
                                                  TensorView<const double> dout,
                                                  const LinformerOptions& opts, double u) {
  const Arith a{u};
  const linformer::Setup s =
      linformer::check_args("reference::linformer_attention_backward", q, k, v, e, f, opts);
  const AttentionDims& d = s.d;
  const KeyMask mask(d, s.mask_opts);
  Bounded dq = zero_bounded(q.shape), dk = zero_bounded(k.shape), dv = zero_bounded(v.shape),
          de = zero_bounded(e.shape), df = zero_bounded(f.shape);
  for (int64_t bh = 0; bh < d.bh(); ++bh) {
    const int64_t L = mask.key_length(bh / d.heads), h = bh % d.heads;
    const Head x = head(a, s, q, k, v, e, f, bh, L);
    const Tracked G = input(dout.row(bh, 0), d.n_q, d.value_dim, d.value_dim);
    const Tracked dVp = matmul(a, x.P, true, G, false);
    const Tracked dS = softmax_rows_backward(a, x.P, matmul(a, G, false, x.Vp, true));
    const Tracked dKp = matmul(a, dS, true, x.Q, false, s.scale);
    store(matmul(a, dS, false, x.Kp, false, s.scale), dq, bh * d.n_q * d.head_dim, d.head_dim);
    store(matmul(a, x.E, true, dKp, false), dk, bh * d.n_k * d.head_dim, d.head_dim);
    store(matmul(a, x.F, true, dVp, false), dv, bh * d.n_k * d.value_dim, d.value_dim);
    accumulate(a, matmul(a, dKp, false, x.K, true), de, s.offset(h), s.n_max);
    accumulate(a, matmul(a, dVp, false, x.V, true), df, s.offset(h), s.n_max);
  }
  std::vector<Bounded> grads;
  for (Bounded* g : {&dq, &dk, &dv, &de, &df}) grads.push_back(std::move(*g));
  return grads;
}

}  // namespace linattn::reference

namespace linattn::reference {

ReferenceInfo reference_linformer() {
  ReferenceInfo r;
  r.forward = [](const MethodArgs<double>& a) {
    const auto c = linformer::call_from(a);
    return linformer_attention(a.q, a.k, a.v, c.e, c.f, c.opts).value;
  };
  r.backward = [](const MethodArgs<double>& a, TensorView<const double> dout) {
    const auto c = linformer::call_from(a);
    auto b = linformer_attention_backward(a.q, a.k, a.v, c.e, c.f, dout, c.opts);
    AttentionGrads<double> g{std::move(b[0].value), std::move(b[1].value), std::move(b[2].value), {}};
    g.params.emplace_back("e", std::move(b[3].value));
    g.params.emplace_back("f", std::move(b[4].value));
    return g;
  };
  return r;
}

}  // namespace linattn::reference
