// Linformer forward and backward. Per (batch, head): K' = E_L·K_L [s,d], V' = F_L·V_L [s,d_v]
// (E_L, F_L the first L = key_length columns), then blocks of query rows:
// out_blk = softmax(Q_blk K'ᵀ·s)·V'. The backward recomputes K', V' and the blocks, and writes
// dK', dV' per head; dE, dF are then summed over the heads that share them, in a second loop
// over column blocks, so no two tasks write the same element (no atomics).
#include <cmath>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/blas.h"
#include "linattn/core/random.h"
#include "linattn/core/row_softmax.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/linformer/internal.h"

namespace linattn {
namespace linformer {

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 TensorView<const T> e, TensorView<const T> f, const LinformerOptions& opts) {
  Setup s{check_noncausal_args(fn, q, k, v, opts,
                               "Linformer projects keys and values over the whole sequence, so "
                               "every output would see future positions")};
  require(e.rank() == 2 || e.rank() == 3, fn, ": e has shape ", shape_string(e.shape),
          "; expected [s_proj, n_max] or [heads, s_proj, n_max]");
  require(f.shape == e.shape, fn, ": f has shape ", shape_string(f.shape),
          "; expected the shape of e, ", shape_string(e.shape));
  s.per_head = e.rank() == 3;
  require(!s.per_head || e.dim(0) == s.d.heads, fn, ": e has shape ", shape_string(e.shape),
          "; its first dimension must be heads = ", s.d.heads);
  s.s_proj = e.dim(-2);
  s.n_max = e.dim(-1);
  require(s.s_proj >= 1, fn, ": s_proj (rows of e) must be >= 1, got shape ", shape_string(e.shape));
  require(s.d.n_k <= s.n_max, fn, ": the key sequence length n_k = ", s.d.n_k,
          " exceeds n_max = ", s.n_max, ", the columns of e and f");
  for (const auto* x : {&e, &f}) {
    const char* name = x == &e ? "e" : "f";
    require(x->size() == 0 || x->data != nullptr, fn, ": ", name, " has no data");
    check_finite(fn, name, *x);
  }
  return s;
}

template <class T>
struct Buffers {
  explicit Buffers(const Setup& s, bool backward)
      : kp(s.s_proj * s.d.head_dim),
        vp(s.s_proj * s.d.value_dim),
        p(std::min(kRowBlock, s.d.n_q) * s.s_proj),
        dp(backward ? std::min(kRowBlock, s.d.n_q) * s.s_proj : 0) {}
  Buffer<T> kp, vp, p, dp;
};

// K' = E_L·K_L and V' = F_L·V_L for head bh.
template <class T>
void project(const Setup& s, TensorView<const T> k, TensorView<const T> v, TensorView<const T> e,
             TensorView<const T> f, int64_t bh, int64_t L, Buffers<T>& b) {
  const int64_t h = bh % s.d.heads;
  matmul<T>(mat(b.kp.data(), s.s_proj, s.d.head_dim),
            mat(e.data + s.offset(h), s.s_proj, L, s.n_max), mat(k.row(bh, 0), L, s.d.head_dim));
  matmul<T>(mat(b.vp.data(), s.s_proj, s.d.value_dim),
            mat(f.data + s.offset(h), s.s_proj, L, s.n_max), mat(v.row(bh, 0), L, s.d.value_dim));
}

}  // namespace linformer

template <class T>
Tensor<T> linformer_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v_arg,
                              TensorView<const T> e, TensorView<const T> f,
                              const LinformerOptions& opts) {
  const char* fn = "linformer_attention";
  const linformer::Setup s = linformer::check_args(fn, q, k, v_arg, e, f, opts);
  const AttentionDims& d = s.d;
  const ValueScale<T> vs(v_arg, d.v_max);  // out is linear in v (range.h)
  const TensorView<const T> v = vs.view();
  const KeyMask mask(d, s.mask_opts);
  // out [B,H,n_q,d_v]: every row is written below (P·V' = 0 for an item without keys).
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim}, false, Init::Uninitialized);
  const T sc = static_cast<T>(s.scale);
  const ParallelLoop loop(d.bh());
  PerWorker<linformer::Buffers<T>> buffers(loop, [&] { return linformer::Buffers<T>(s, false); });
  loop.run([&](int64_t bh, int worker) {
    linformer::Buffers<T>& b = buffers[worker];
    linformer::project(s, k, v, e, f, bh, mask.key_length(bh / d.heads), b);
    for (int64_t r0 = 0; r0 < d.n_q; r0 += linformer::kRowBlock) {
      interruption_point();
      const int64_t rows = std::min(linformer::kRowBlock, d.n_q - r0);
      matmul<T>(mat(b.p.data(), rows, s.s_proj), mat(q.row(bh, r0), rows, d.head_dim),
                mat(b.kp.data(), s.s_proj, d.head_dim).t(), sc);
      softmax_rows(fn, b.p.data(), rows, s.s_proj, s.s_proj);
      matmul<T>(mat(out.view().row(bh, r0), rows, d.value_dim), mat(b.p.data(), rows, s.s_proj),
                mat(b.vp.data(), s.s_proj, d.value_dim));
    }
  });
  vs.restore(out);
  check_result_finite(fn, "the output", out);
  return out;
}

template <class T>
AttentionGrads<T> linformer_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                               TensorView<const T> v_arg, TensorView<const T> e,
                                               TensorView<const T> f, TensorView<const T> dout_arg,
                                               const LinformerOptions& opts) {
  const char* fn = "linformer_attention_backward";
  const linformer::Setup s = linformer::check_args(fn, q, k, v_arg, e, f, opts);
  const AttentionDims& d = s.d;
  const double dout_max =
      check_same_shape_finite(fn, "dout", dout_arg, {d.batch, d.heads, d.n_q, d.value_dim});
  const ValueScale<T> vs(v_arg, d.v_max), gs(dout_arg, dout_max);  // range.h
  const TensorView<const T> v = vs.view(), dout = gs.view();
  const KeyMask mask(d, s.mask_opts);
  AttentionGrads<T> g{Tensor<T>(q.shape), Tensor<T>(k.shape), Tensor<T>(v.shape), {}};
  g.params.emplace_back("e", Tensor<T>(e.shape));
  g.params.emplace_back("f", Tensor<T>(f.shape));
  Tensor<T>& de = g.params[0].second;
  Tensor<T>& df = g.params[1].second;
  const int64_t hd = d.head_dim, dv = d.value_dim, sp = s.s_proj;
  const T sc = static_cast<T>(s.scale);
  // dK' [BH, s, d] and dV' [BH, s, d_v]: O(B·H·s·d), independent of n.
  Tensor<T> dkp({d.bh(), sp, hd}, true), dvp({d.bh(), sp, dv}, true);
  const ParallelLoop loop(d.bh());
  PerWorker<linformer::Buffers<T>> buffers(loop, [&] { return linformer::Buffers<T>(s, true); });
  loop.run([&](int64_t bh, int worker) {
    linformer::Buffers<T>& b = buffers[worker];
    const int64_t L = mask.key_length(bh / d.heads), h = bh % d.heads;
    linformer::project(s, k, v, e, f, bh, L, b);
    T *dk_p = dkp.data() + bh * sp * hd, *dv_p = dvp.data() + bh * sp * dv;
    for (int64_t r0 = 0; r0 < d.n_q; r0 += linformer::kRowBlock) {
      interruption_point();
      const int64_t rows = std::min(linformer::kRowBlock, d.n_q - r0);
      const T* go = dout.row(bh, r0);
      matmul<T>(mat(b.p.data(), rows, sp), mat(q.row(bh, r0), rows, hd),
                mat(b.kp.data(), sp, hd).t(), sc);
      softmax_rows(fn, b.p.data(), rows, sp, sp);
      // out = P·V': dV' += Pᵀ dout, dP = dout V'ᵀ
      matmul<T>(mat(dv_p, sp, dv), mat(b.p.data(), rows, sp).t(), mat(go, rows, dv), T(1), T(1));
      matmul<T>(mat(b.dp.data(), rows, sp), mat(go, rows, dv), mat(b.vp.data(), sp, dv).t());
      softmax_rows_backward(b.p.data(), b.dp.data(), rows, sp, sp, sp);
      // S = s·Q K'ᵀ: dq = s·dS K', dK' += s·dSᵀ Q
      matmul<T>(mat(g.dq.view().row(bh, r0), rows, hd), mat(b.dp.data(), rows, sp),
                mat(b.kp.data(), sp, hd), sc);
      matmul<T>(mat(dk_p, sp, hd), mat(b.dp.data(), rows, sp).t(), mat(q.row(bh, r0), rows, hd), sc,
                T(1));
    }
    // K' = E_L K_L: dk_L = E_Lᵀ dK'; V' = F_L V_L: dv_L = F_Lᵀ dV'
    matmul<T>(mat(g.dk.view().row(bh, 0), L, hd), mat(e.data + s.offset(h), sp, L, s.n_max).t(),
              mat(dk_p, sp, hd));
    matmul<T>(mat(g.dv.view().row(bh, 0), L, dv), mat(f.data + s.offset(h), sp, L, s.n_max).t(),
              mat(dv_p, sp, dv));
  });
  linformer::add_projection_grads(s, mask, k, v, dkp.data(), sp * hd, hd, dvp.data(), sp * dv, dv, 0, de.data(),
                                  df.data());
  restore_gradients(fn, g, vs.exponent(), gs.exponent());
  return g;
}

template <class T>
std::pair<Tensor<T>, Tensor<T>> linformer_projections(int64_t s_proj, int64_t n_max, int64_t heads,
                                                      uint64_t seed) {
  const char* fn = "linformer_projections";
  require(heads >= 0, fn, ": heads must be >= 0 (0: shared by all heads), got ", heads);
  if (heads == 0)
    sized_by_arguments(fn, "e and f", {{"s_proj", s_proj}, {"n_max", n_max}}, sizeof(T), 2);
  else
    sized_by_arguments(fn, "e and f", {{"heads", heads}, {"s_proj", s_proj}, {"n_max", n_max}}, sizeof(T), 2);
  const Shape shape = heads == 0 ? Shape{s_proj, n_max} : Shape{heads, s_proj, n_max};
  const double a = std::sqrt(3.0 / static_cast<double>(n_max + s_proj));
  std::pair<Tensor<T>, Tensor<T>> ef{Tensor<T>(shape), Tensor<T>(shape)};
  Rng re(seed), rf(seed + 1);
  for (int64_t i = 0; i < ef.first.size(); ++i) {
    ef.first[i] = static_cast<T>(a * (2 * re.uniform() - 1));
    ef.second[i] = static_cast<T>(a * (2 * rf.uniform() - 1));
  }
  return ef;
}

#define LINATTN_INSTANTIATE(T)                                                                  \
  template linformer::Setup linformer::check_args<T>(                                           \
      const char*, TensorView<const T>, TensorView<const T>, TensorView<const T>,               \
      TensorView<const T>, TensorView<const T>, const LinformerOptions&);                       \
  template Tensor<T> linformer_attention(TensorView<const T>, TensorView<const T>,              \
                                         TensorView<const T>, TensorView<const T>,              \
                                         TensorView<const T>, const LinformerOptions&);         \
  template AttentionGrads<T> linformer_attention_backward(                                      \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,       \
      TensorView<const T>, TensorView<const T>, const LinformerOptions&);                       \
  template std::pair<Tensor<T>, Tensor<T>> linformer_projections<T>(int64_t, int64_t, int64_t,  \
                                                                    uint64_t);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
