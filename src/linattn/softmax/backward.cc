// Exact attention backward (FlashAttention-2 order) from the saved log-sum-exp.
// Forward: s_ij = scale·q_i·k_j, p_ij = exp(s_ij − lse_i), out_i = Σ_j p_ij v_j.
// Backward, per (batch·head, block of keys), looping over the query blocks that see it:
//   P  = exp(scale·Q_blk·K_blkᵀ − lse)            recompute p_ij
//   dV_blk += Pᵀ·dO_blk                            from out_i = Σ_j p_ij v_j
//   dP = dO_blk·V_blkᵀ;  dS = P∘(dP − δ), δ_i = dout_i·out_i   softmax backward
//   dK_blk += scale·dSᵀ·Q_blk;  dQ_blk += scale·dS·K_blk      from s_ij = scale·q_i·k_j
// Each task owns its keys' dK, dV rows. dQ is owned per (batch·head) when there are at least
// as many (batch·head) as workers; otherwise key ranges are split across workers, each with
// its own dQ partial, summed at the end. No atomics either way.
// This is the float64 path; float32 runs on linattn's own product kernels (backward_f32.cc).
#include <cmath>
#include <limits>
#include <type_traits>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/blas.h"
#include "linattn/core/simd.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/softmax/forward_internal.h"

namespace linattn {
namespace {

constexpr int64_t kBlockQ = softmax_detail::kBackwardBlockQ;
constexpr int64_t kBlockK = softmax_detail::kBackwardBlockK;

template <class T>
struct Tile {
  Buffer<T> p{kBlockQ * kBlockK};
  Buffer<T> dp{kBlockQ * kBlockK};  // dP, then dS in place
};

template <class T>
struct BackwardArgs {
  TensorView<const T> q, k, v, dout;
  const T* lse;
  const T* delta;
  AttentionDims d;
  const KeyMask* mask;
  T scale;
};

// dK, dV for keys [j_begin, j_end) of one batch·head; dQ contributions into dq (n_q rows).
template <class T>
void backward_keys(const BackwardArgs<T>& a, int64_t bh, int64_t j_begin, int64_t j_end,
                   Tile<T>& t, T* dq, T* dk, T* dv) {
  const AttentionDims& d = a.d;
  const int64_t b = bh / d.heads;
  const int64_t key_len = a.mask->key_length(b);
  for (int64_t j0 = j_begin; j0 < std::min(j_end, key_len); j0 += kBlockK) {
    interruption_point();
    const int64_t bk = std::min({kBlockK, j_end - j0, key_len - j0});
    T* dk_blk = dk + (bh * d.n_k + j0) * d.head_dim;
    T* dv_blk = dv + (bh * d.n_k + j0) * d.value_dim;
    // First query that sees key j0: visible(b, i) is non-decreasing in i.
    int64_t i_start = 0;
    if (a.mask->causal()) i_start = std::max<int64_t>(0, j0 - (d.n_k - d.n_q));
    for (int64_t i0 = i_start; i0 < d.n_q; i0 += kBlockQ) {
      interruption_point();
      const int64_t bq = std::min(kBlockQ, d.n_q - i0);
      matmul<T>(mat(t.p.data(), bq, bk, kBlockK), mat(a.q.row(bh, i0), bq, d.head_dim),
                mat(a.k.row(bh, j0), bk, d.head_dim).t(), a.scale);
      for (int64_t r = 0; r < bq; ++r) {
        T* prow = t.p.data() + r * kBlockK;
        const T lse = a.lse[bh * d.n_q + i0 + r];
        const int64_t c =
            std::isfinite(lse) ? std::clamp<int64_t>(a.mask->visible(b, i0 + r) - j0, 0, bk) : 0;
        if (c > 0) simd::exp_shifted_sum(prow, static_cast<size_t>(c), lse);
        for (int64_t j = c; j < bk; ++j) prow[j] = 0;
      }
      matmul<T>(mat(dv_blk, bk, d.value_dim), mat(t.p.data(), bq, bk, kBlockK).t(),
                mat(a.dout.row(bh, i0), bq, d.value_dim), T(1), T(1));
      matmul<T>(mat(t.dp.data(), bq, bk, kBlockK), mat(a.dout.row(bh, i0), bq, d.value_dim),
                mat(a.v.row(bh, j0), bk, d.value_dim).t());
      for (int64_t r = 0; r < bq; ++r)
        simd::softmax_grad(t.dp.data() + r * kBlockK, t.p.data() + r * kBlockK,
                           t.dp.data() + r * kBlockK, static_cast<size_t>(bk),
                           a.delta[bh * d.n_q + i0 + r]);
      matmul<T>(mat(dk_blk, bk, d.head_dim), mat(t.dp.data(), bq, bk, kBlockK).t(),
                mat(a.q.row(bh, i0), bq, d.head_dim), a.scale, T(1));
      matmul<T>(mat(dq + i0 * d.head_dim, bq, d.head_dim), mat(t.dp.data(), bq, bk, kBlockK),
                mat(a.k.row(bh, j0), bk, d.head_dim), a.scale, T(1));
    }
  }
}

template <class T>
AttentionGrads<T> backward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                           TensorView<const T> dout, TensorView<const T> out,
                           TensorView<const T> lse, const AttentionDims& d,
                           const AttentionOptions& opts, double scale) {
  if constexpr (std::is_same_v<T, float>) {
    return softmax_detail::backward_f32(q, k, v, dout, out, lse, d, opts, scale);
  } else {
    AttentionGrads<T> g{Tensor<T>(q.shape), Tensor<T>(k.shape), Tensor<T>(v.shape), {}};
    if (d.bh() == 0) return g;
    const KeyMask mask(d, opts);
    const int workers = num_threads();

    // δ_i = dout_i · out_i = Σ_j p_ij dp_ij
    Buffer<T> delta(d.bh() * d.n_q);
    parallel_for(d.bh(), [&](int64_t bh) {
      for (int64_t i = 0; i < d.n_q; ++i)
        delta[bh * d.n_q + i] =
            simd::dot(dout.row(bh, i), out.row(bh, i), static_cast<size_t>(d.value_dim));
    });

    const softmax_detail::KeySplits keys(d, kBlockK, workers);
    const int64_t splits = keys.splits;
    Buffer<T> dq_partial(splits > 1 ? splits * d.bh() * d.n_q * d.head_dim : 0);
    const BackwardArgs<T> args{q, k, v, dout, lse.data, delta.data(), d, &mask, static_cast<T>(scale)};
    const ParallelLoop loop(d.bh() * splits);
    PerWorker<Tile<T>> tiles(loop);
    loop.run([&](int64_t task, int worker) {
      const int64_t bh = task / splits, s = task % splits;
      T* dq = splits > 1 ? dq_partial.data() + (s * d.bh() + bh) * d.n_q * d.head_dim
                         : g.dq.data() + bh * d.n_q * d.head_dim;
      backward_keys(args, bh, keys.begin(s), keys.end(s), tiles[worker], dq, g.dk.data(), g.dv.data());
    });
    if (splits > 1) {
      const int64_t per_bh = d.n_q * d.head_dim;
      parallel_for(d.bh(), [&](int64_t bh) {
        T* dst = g.dq.data() + bh * per_bh;
        for (int64_t s = 0; s < splits; ++s) {
          const T* src = dq_partial.data() + (s * d.bh() + bh) * per_bh;
          for (int64_t i = 0; i < per_bh; ++i) dst[i] += src[i];
        }
      });
    }
    return g;
  }
}

}  // namespace

template <class T>
void softmax_detail::check_saved(const char* fn, TensorView<const T> out, TensorView<const T> lse,
                                 const AttentionDims& d) {
  check_same_shape_finite(fn, "out", out, {d.batch, d.heads, d.n_q, d.value_dim});
  require(lse.shape == Shape{d.batch, d.heads, d.n_q}, fn, ": lse has shape ",
          shape_string(lse.shape), "; expected ", shape_string({d.batch, d.heads, d.n_q}));
  for (int64_t i = 0; i < lse.size(); ++i)
    require(!std::isnan(lse.data[i]) && lse.data[i] != std::numeric_limits<T>::infinity(), fn,
            ": lse[", i, "] = ", lse.data[i], "; expected a finite value or -inf");
}
template void softmax_detail::check_saved(const char*, TensorView<const float>, TensorView<const float>,
                                          const AttentionDims&);
template void softmax_detail::check_saved(const char*, TensorView<const double>, TensorView<const double>,
                                          const AttentionDims&);

template <class T>
AttentionGrads<T> softmax_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                             TensorView<const T> v, TensorView<const T> dout,
                                             TensorView<const T> out, TensorView<const T> lse,
                                             const AttentionOptions& opts) {
  const char* fn = "softmax_attention_backward";
  const AttentionDims d = check_attention_args(fn, q, k, v, opts);
  const double scale = resolve_scale(fn, opts, d.head_dim);
  const double dout_max = check_same_shape_finite(fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  softmax_detail::check_saved(fn, out, lse, d);
  // Gradients are linear in v and dout (range.h); out scales with v.
  const ValueScale<T> vs(v, d.v_max), gs(dout, dout_max), os(out, vs);
  AttentionGrads<T> g = backward(q, k, vs.view(), gs.view(), os.view(), lse, d, opts, scale);
  restore_gradients(fn, g, vs.exponent(), gs.exponent());
  return g;
}

template <class T>
AttentionGrads<T> softmax_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                             TensorView<const T> v, TensorView<const T> dout,
                                             const AttentionOptions& opts) {
  const char* fn = "softmax_attention_backward";
  const AttentionDims d = check_attention_args(fn, q, k, v, opts);
  const double scale = resolve_scale(fn, opts, d.head_dim);
  const double dout_max = check_same_shape_finite(fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  const ValueScale<T> vs(v, d.v_max), gs(dout, dout_max);  // range.h
  const auto fwd = softmax_detail::forward(q, k, vs.view(), d, opts, scale, /*as_workspace=*/true);
  AttentionGrads<T> g = backward(q, k, vs.view(), gs.view(), fwd.out.view(), fwd.lse.view(), d, opts, scale);
  restore_gradients(fn, g, vs.exponent(), gs.exponent());
  return g;
}

#define LINATTN_INSTANTIATE(T)                                                                 \
  template AttentionGrads<T> softmax_attention_backward(                                       \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,      \
      TensorView<const T>, TensorView<const T>, const AttentionOptions&);                      \
  template AttentionGrads<T> softmax_attention_backward(TensorView<const T>, TensorView<const T>, \
                                                        TensorView<const T>, TensorView<const T>, \
                                                        const AttentionOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
