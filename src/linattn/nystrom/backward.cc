// Nyström backward: per head, recompute the landmark side (keeping the pinv iterates), then
//   blocks of query rows: F1 = softmax(Q_blk K̃ᵀ·s); dY += F1ᵀ dout; dS1 = softmax'(dout Yᵀ);
//     dq_blk = s·dS1 K̃; dK̃ += s·dS1ᵀ Q_blk
//   Y = Z·W: dZ = dY Wᵀ, dW = Zᵀ dY;  W = F3·V_L: dF3 = dW V_Lᵀ, dv_L = F3ᵀ dW
//   F3 = softmax(Q̃K_Lᵀ·s): dQ̃ += s·dS3 K_L, dk_L = s·dS3ᵀ Q̃
//   Z = pinv(A): dA;  A = softmax(Q̃K̃ᵀ·s): dQ̃ += s·dS2 K̃, dK̃ += s·dS2ᵀ Q̃
//   Q̃, K̃ = segment means: dq_i += dQ̃_j/len_j, dk_i += dK̃_j/len_j for i in segment j.
// Parallel over (batch, head): each task owns its rows of dq, dk, dv, so no atomics.
#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/depthwise_conv.h"
#include "linattn/core/row_softmax.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/nystrom/internal.h"

namespace linattn {
namespace {

// x[i] += g[j]·(1/len_j) for every position i of segment j: undoes the segment means.
template <class T>
void unpool(const T* g, int64_t L, int64_t m, int64_t d, T* x, int64_t ld) {
  for (int64_t j = 0; j < m; ++j) {
    const int64_t b = segment_begin(j, L, m), e = segment_end(j, L, m);
    const T inv = T(1) / static_cast<T>(e - b);
    for (int64_t i = b; i < e; ++i)
      for (int64_t c = 0; c < d; ++c) x[i * ld + c] += g[j * d + c] * inv;
  }
}

}  // namespace

template <class T>
AttentionGrads<T> nystrom_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                             TensorView<const T> v_arg, TensorView<const T> dout_arg,
                                             const NystromOptions& opts,
                                             std::optional<TensorView<const T>> conv_weight) {
  const char* fn = "nystrom_attention_backward";
  const nystrom::Setup s = nystrom::check_args(fn, q, k, v_arg, opts, conv_weight);
  const AttentionDims& d = s.d;
  const double dout_max =
      check_same_shape_finite(fn, "dout", dout_arg, {d.batch, d.heads, d.n_q, d.value_dim});
  const ValueScale<T> vs(v_arg, d.v_max), gs(dout_arg, dout_max);  // range.h
  const TensorView<const T> v = vs.view(), dout = gs.view();
  const KeyMask mask(d, s.mask_opts);
  AttentionGrads<T> g{Tensor<T>(q.shape), Tensor<T>(k.shape), Tensor<T>(v.shape), {}};
  const int64_t hd = d.head_dim, dv = d.value_dim;
  const T sc = static_cast<T>(s.scale);
  const ParallelLoop loop(d.bh());
  PerWorker<nystrom::HeadBuffers<T>> buffers(loop, [&] { return nystrom::HeadBuffers<T>(s, true); });
  loop.run([&](int64_t bh, int worker) {
    const int64_t L = mask.key_length(bh / d.heads), m = std::min(s.max_landmarks, L);
    if (L == 0) return;  // the attention term is 0 and so are its gradients
    nystrom::HeadBuffers<T>& hb = buffers[worker];
    nystrom::landmark_side(fn, s, q, k, v, bh, L, m, hb, true);
    T *dy = hb.dy.data(), *dqt = hb.dqt.data(), *dkt = hb.dkt.data(), *ds = hb.dscores.data();
    std::fill(dy, dy + m * dv, T(0));
    std::fill(dqt, dqt + m * hd, T(0));
    std::fill(dkt, dkt + m * hd, T(0));
    // out_blk = softmax(Q_blk K̃ᵀ·s)·Y
    for (int64_t r0 = 0; r0 < d.n_q; r0 += nystrom::kRowBlock) {
      interruption_point();
      const int64_t rows = std::min(nystrom::kRowBlock, d.n_q - r0);
      T* f1 = hb.scores.data();
      const T* go = dout.row(bh, r0);
      matmul<T>(mat(f1, rows, m), mat(q.row(bh, r0), rows, hd), mat(hb.kt.data(), m, hd).t(), sc);
      softmax_rows(fn, f1, rows, m, m);
      matmul<T>(mat(dy, m, dv), mat(f1, rows, m).t(), mat(go, rows, dv), T(1), T(1));
      matmul<T>(mat(ds, rows, m), mat(go, rows, dv), mat(hb.y.data(), m, dv).t());
      softmax_rows_backward(f1, ds, rows, m, m, m);
      matmul<T>(mat(g.dq.view().row(bh, r0), rows, hd), mat(ds, rows, m), mat(hb.kt.data(), m, hd),
                sc);
      matmul<T>(mat(dkt, m, hd), mat(ds, rows, m).t(), mat(q.row(bh, r0), rows, hd), sc, T(1));
    }
    // Y = Z·W
    matmul<T>(mat(hb.dz.data(), m, m), mat(dy, m, dv), mat(hb.w.data(), m, dv).t());
    matmul<T>(mat(hb.dw.data(), m, dv), mat(hb.z.data(), m, m).t(), mat(dy, m, dv));
    // W = F3·V_L
    matmul<T>(mat(ds, m, L), mat(hb.dw.data(), m, dv), mat(v.row(bh, 0), L, dv).t());
    matmul<T>(mat(g.dv.view().row(bh, 0), L, dv), mat(hb.f3.data(), m, L).t(),
              mat(hb.dw.data(), m, dv));
    // F3 = softmax(Q̃ K_Lᵀ·s)
    softmax_rows_backward(hb.f3.data(), ds, m, L, L, L);
    matmul<T>(mat(dqt, m, hd), mat(ds, m, L), mat(k.row(bh, 0), L, hd), sc, T(1));
    matmul<T>(mat(g.dk.view().row(bh, 0), L, hd), mat(ds, m, L).t(), mat(hb.qt.data(), m, hd), sc);
    // Z = pinv(A), A = softmax(Q̃ K̃ᵀ·s)
    nystrom::pinv_backward<T>(s.pinv, hb.a.data(), hb.z.data(), m, s.iterations, hb.iterates.data(),
                              hb.dz.data(), hb.da.data(), hb.pinv_scratch.data());
    softmax_rows_backward(hb.a.data(), hb.da.data(), m, m, m, m);
    matmul<T>(mat(dqt, m, hd), mat(hb.da.data(), m, m), mat(hb.kt.data(), m, hd), sc, T(1));
    matmul<T>(mat(dkt, m, hd), mat(hb.da.data(), m, m).t(), mat(hb.qt.data(), m, hd), sc, T(1));
    // Q̃, K̃ = segment means of the valid positions
    unpool(dqt, L, m, hd, g.dq.view().row(bh, 0), hd);
    unpool(dkt, L, m, hd, g.dk.view().row(bh, 0), hd);
  });
  if (conv_weight) {
    Tensor<T> dw(conv_weight->shape);
    depthwise_conv_backward(v, *conv_weight, dout.data, d, mask, false, g.dv.data(), dw.data());
    g.params.emplace_back("conv_weight", std::move(dw));
  }
  restore_gradients(fn, g, vs.exponent(), gs.exponent());
  return g;
}

template AttentionGrads<float> nystrom_attention_backward(
    TensorView<const float>, TensorView<const float>, TensorView<const float>,
    TensorView<const float>, const NystromOptions&, std::optional<TensorView<const float>>);
template AttentionGrads<double> nystrom_attention_backward(
    TensorView<const double>, TensorView<const double>, TensorView<const double>,
    TensorView<const double>, const NystromOptions&, std::optional<TensorView<const double>>);

}  // namespace linattn
