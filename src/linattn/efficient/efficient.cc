// Efficient Attention forward and backward, per (batch, head):
//   E = exp(K_L·s − column max) [L, d], kept unnormalised, with inv_c = 1/Σ_j E[j,c], so the
//   softmax over positions is ρ_k = E·diag(inv) (computed down the columns of the row-major K:
//   no transpose); G = ρ_kᵀ V_L = diag(inv)·(Eᵀ V_L) [d, d_v];
//   blocks of query rows: ρ_q = softmax over features of Q_blk·s; out_blk = ρ_q G.
// Backward: dG = Σ_blk ρ_qᵀ dout, dq = s·softmax'(ρ_q, dout Gᵀ); dρ_k = V_L dGᵀ,
//   dk_L = s·ρ_k∘(dρ_k − colsum(ρ_k∘dρ_k)), dv_L = ρ_k dG = E·(diag(inv) dG).
// Parallel over (batch, head): no atomics.
#include <algorithm>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/blas.h"
#include "linattn/core/row_softmax.h"
#include "linattn/core/simd.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/efficient/internal.h"

namespace linattn {
namespace efficient {

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 const EfficientAttentionOptions& opts) {
  return check_noncausal_args(fn, q, k, v, opts,
                              "Efficient Attention normalises keys over all positions, so every "
                              "output would see future positions");
}

// E [L, d], inv [d] and G = diag(inv)·Eᵀ V_L [d, d_v] for head bh.
template <class T>
void key_side(const char* fn, const Setup& s, TensorView<const T> k, TensorView<const T> v,
              int64_t bh, int64_t L, Buffers<T>& b) {
  const int64_t hd = s.d.head_dim, dv = s.d.value_dim;
  require(simd::softmax_columns(k.row(bh, 0), static_cast<size_t>(hd), b.e.data(), static_cast<size_t>(L),
                                static_cast<size_t>(hd), static_cast<T>(s.scale), b.inv.data(), b.work.data()),
          fn, ": attention scores overflowed to inf or NaN; the inputs are too large for this dtype");
  matmul<T>(mat(b.g.data(), hd, dv), mat(b.e.data(), L, hd).t(), mat(v.row(bh, 0), L, dv));
  for (int64_t c = 0; c < hd; ++c) simd::scale(b.g.data() + c * dv, static_cast<size_t>(dv), b.inv[c]);
}

}  // namespace efficient

template <class T>
Tensor<T> efficient_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v_arg,
                              const EfficientAttentionOptions& opts) {
  const char* fn = "efficient_attention";
  const efficient::Setup s = efficient::check_args(fn, q, k, v_arg, opts);
  const AttentionDims& d = s.d;
  const ValueScale<T> vs(v_arg, d.v_max);  // out is linear in v (range.h)
  const TensorView<const T> v = vs.view();
  const KeyMask mask(d, s.mask_opts);
  // out [B,H,n_q,d_v]: every row is written below (zeros for items without keys).
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim}, false, Init::Uninitialized);
  const ParallelLoop loop(d.bh());
  PerWorker<efficient::Buffers<T>> buffers(loop, [&] { return efficient::Buffers<T>(s, false); });
  loop.run([&](int64_t bh, int worker) {
    const int64_t L = mask.key_length(bh / d.heads);
    if (L == 0) {  // no keys: out = 0
      std::fill(out.view().row(bh, 0), out.view().row(bh, 0) + d.n_q * d.value_dim, T(0));
      return;
    }
    efficient::Buffers<T>& b = buffers[worker];
    efficient::key_side(fn, s, k, v, bh, L, b);
    for (int64_t r0 = 0; r0 < d.n_q; r0 += efficient::kRowBlock) {
      interruption_point();
      const int64_t rows = std::min(efficient::kRowBlock, d.n_q - r0);
      efficient::query_block(fn, s, q, bh, r0, rows, b);
      matmul<T>(mat(out.view().row(bh, r0), rows, d.value_dim), mat(b.qb.data(), rows, d.head_dim),
                mat(b.g.data(), d.head_dim, d.value_dim));
    }
  });
  vs.restore(out);
  check_result_finite(fn, "the output", out);
  return out;
}

template <class T>
AttentionGrads<T> efficient_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                               TensorView<const T> v_arg, TensorView<const T> dout_arg,
                                               const EfficientAttentionOptions& opts) {
  const char* fn = "efficient_attention_backward";
  const efficient::Setup s = efficient::check_args(fn, q, k, v_arg, opts);
  const AttentionDims& d = s.d;
  const double dout_max =
      check_same_shape_finite(fn, "dout", dout_arg, {d.batch, d.heads, d.n_q, d.value_dim});
  const ValueScale<T> vs(v_arg, d.v_max), gs(dout_arg, dout_max);  // range.h
  const TensorView<const T> v = vs.view(), dout = gs.view();
  const KeyMask mask(d, s.mask_opts);
  // Every element of dq, dk, dv is written below: the rows the products give, padded keys' rows
  // and items without keys with 0.
  AttentionGrads<T> g{Tensor<T>(q.shape, false, Init::Uninitialized), Tensor<T>(k.shape, false, Init::Uninitialized),
                      Tensor<T>(v.shape, false, Init::Uninitialized), {}};
  const int64_t hd = d.head_dim, dv = d.value_dim;
  const T sc = static_cast<T>(s.scale);
  const ParallelLoop loop(d.bh());
  PerWorker<efficient::Buffers<T>> buffers(loop, [&] { return efficient::Buffers<T>(s, true); });
  PerWorker<WrittenFinite> written(loop);  // range.h
  loop.run([&](int64_t bh, int worker) {
    const int64_t L = mask.key_length(bh / d.heads);
    std::fill(g.dk.view().row(bh, L), g.dk.view().row(bh, 0) + d.n_k * hd, T(0));
    std::fill(g.dv.view().row(bh, L), g.dv.view().row(bh, 0) + d.n_k * dv, T(0));
    if (L == 0) {  // out = 0 for any q, k, v: all gradients 0
      std::fill(g.dq.view().row(bh, 0), g.dq.view().row(bh, 0) + d.n_q * hd, T(0));
      return;
    }
    WrittenFinite& finite = written[worker];
    efficient::Buffers<T>& b = buffers[worker];
    efficient::key_side(fn, s, k, v, bh, L, b);
    std::fill(b.dg.data(), b.dg.data() + hd * dv, T(0));
    for (int64_t r0 = 0; r0 < d.n_q; r0 += efficient::kRowBlock) {
      interruption_point();
      const int64_t rows = std::min(efficient::kRowBlock, d.n_q - r0);
      const T* go = dout.row(bh, r0);
      efficient::query_block(fn, s, q, bh, r0, rows, b);
      // out = ρ_q G: dG += ρ_qᵀ dout, dρ_q = dout Gᵀ
      matmul<T>(mat(b.dg.data(), hd, dv), mat(b.qb.data(), rows, hd).t(), mat(go, rows, dv), T(1),
                T(1));
      matmul<T>(mat(b.dqb.data(), rows, hd), mat(go, rows, dv), mat(b.g.data(), hd, dv).t());
      softmax_rows_backward(b.qb.data(), b.dqb.data(), rows, hd, hd, hd);
      T* dq = g.dq.view().row(bh, r0);
      for (int64_t i = 0; i < rows * hd; ++i) dq[i] = sc * b.dqb[i];
      finite.check(dq, rows * hd);
    }
    // G = ρ_kᵀ V_L: dρ_k = V_L dGᵀ (into dk's rows, then the softmax backward in place),
    // dv_L = E·(diag(inv) dG).
    T* dk = g.dk.view().row(bh, 0);
    matmul<T>(mat(dk, L, hd), mat(v.row(bh, 0), L, dv), mat(b.dg.data(), hd, dv).t());
    simd::softmax_columns_backward(b.e.data(), b.inv.data(), dk, static_cast<size_t>(L),
                                   static_cast<size_t>(hd), sc, b.work.data());
    for (int64_t c = 0; c < hd; ++c) simd::scale(b.dg.data() + c * dv, static_cast<size_t>(dv), b.inv[c]);
    matmul<T>(mat(g.dv.view().row(bh, 0), L, dv), mat(b.e.data(), L, hd), mat(b.dg.data(), hd, dv));
    finite.check(dk, L * hd);
    finite.check(g.dv.view().row(bh, 0), L * dv);
  });
  const bool all = all_written_finite(written);
  restore_gradients(fn, g, vs.exponent(), gs.exponent(), {all, all, all});
  return g;
}

#define LINATTN_INSTANTIATE(T)                                                                 \
  template efficient::Setup efficient::check_args<T>(const char*, TensorView<const T>,         \
                                                     TensorView<const T>, TensorView<const T>, \
                                                     const EfficientAttentionOptions&);        \
  template Tensor<T> efficient_attention(TensorView<const T>, TensorView<const T>,             \
                                         TensorView<const T>, const EfficientAttentionOptions&); \
  template AttentionGrads<T> efficient_attention_backward(                                     \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,      \
      const EfficientAttentionOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
