// Nyström forward: per head, the landmark side (Q̃, K̃, pinv, Y = pinv(A)·softmax(Q̃K_Lᵀ·s)·V_L),
// then blocks of query rows: out_blk = softmax(Q_blk K̃ᵀ·s)·Y. Parallel over (batch, head).
#include <algorithm>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/depthwise_conv.h"
#include "linattn/core/row_softmax.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/nystrom/internal.h"

namespace linattn {

template <class T>
Tensor<T> nystrom_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v_arg,
                            const NystromOptions& opts, std::optional<TensorView<const T>> conv_weight) {
  const char* fn = "nystrom_attention";
  const nystrom::Setup s = nystrom::check_args(fn, q, k, v_arg, opts, conv_weight);
  const AttentionDims& d = s.d;
  const ValueScale<T> vs(v_arg, d.v_max);  // out is linear in v (range.h)
  const TensorView<const T> v = vs.view();
  const KeyMask mask(d, s.mask_opts);
  // out [B,H,n,d_v]: every row is written below (zeros for items without keys).
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim}, false, Init::Uninitialized);
  const T sc = static_cast<T>(s.scale);
  const ParallelLoop loop(d.bh());
  PerWorker<nystrom::HeadBuffers<T>> buffers(loop, [&] { return nystrom::HeadBuffers<T>(s, false); });
  loop.run([&](int64_t bh, int worker) {
    const int64_t L = mask.key_length(bh / d.heads), m = std::min(s.max_landmarks, L);
    if (L == 0) {  // no keys: the attention term is 0
      std::fill(out.view().row(bh, 0), out.view().row(bh, 0) + d.n_q * d.value_dim, T(0));
      return;
    }
    nystrom::HeadBuffers<T>& hb = buffers[worker];
    nystrom::landmark_side(fn, s, q, k, v, bh, L, m, hb, false);
    for (int64_t r0 = 0; r0 < d.n_q; r0 += nystrom::kRowBlock) {
      interruption_point();
      const int64_t rows = std::min(nystrom::kRowBlock, d.n_q - r0);
      T* f1 = hb.scores.data();
      matmul<T>(mat(f1, rows, m), mat(q.row(bh, r0), rows, d.head_dim),
                mat(hb.kt.data(), m, d.head_dim).t(), sc);
      softmax_rows(fn, f1, rows, m, m);
      matmul<T>(mat(out.view().row(bh, r0), rows, d.value_dim), mat(f1, rows, m),
                mat(hb.y.data(), m, d.value_dim));
    }
  });
  if (conv_weight) depthwise_conv_forward(v, *conv_weight, d, mask, false, out.data());
  vs.restore(out);
  check_result_finite(fn, "the output", out);
  return out;
}

template Tensor<float> nystrom_attention(TensorView<const float>, TensorView<const float>,
                                         TensorView<const float>, const NystromOptions&,
                                         std::optional<TensorView<const float>>);
template Tensor<double> nystrom_attention(TensorView<const double>, TensorView<const double>,
                                          TensorView<const double>, const NystromOptions&,
                                          std::optional<TensorView<const double>>);

}  // namespace linattn
