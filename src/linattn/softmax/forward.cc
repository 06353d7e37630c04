// Exact attention forward, tiled with an online softmax (FlashAttention-style) on the CPU.
// Per (batch·head, block of kBlockQ queries), over blocks of kBlockK keys:
//   S = scale·Q_blk·K_blkᵀ            (BLAS)
//   m' = max(m, rowmax S); P = exp(S − m'); l = l·exp(m − m') + rowsum P   (SIMD)
//   O = O·exp(m − m') + P·V_blk        (BLAS, accumulating into the output rows)
// then O /= l and lse = m + log l. Extra memory: one kBlockQ×kBlockK tile per worker.
// This is the float64 path; float32 runs on linattn's own product kernels (forward_f32.cc).
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

constexpr int64_t kBlockQ = softmax_detail::kForwardBlockQ;
constexpr int64_t kBlockK = softmax_detail::kForwardBlockK;

template <class T>
struct Tile {
  Buffer<T> s{kBlockQ * kBlockK};  // scores, then probabilities
  Buffer<T> m{kBlockQ}, l{kBlockQ};
  Buffer<int64_t> visible{kBlockQ};
};

template <class T>
void forward_block(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                   const AttentionDims& d, const KeyMask& mask, T scale, int64_t bh, int64_t i0,
                   Tile<T>& t, T* out, T* lse) {
  const int64_t b = bh / d.heads;
  const int64_t bq = std::min(kBlockQ, d.n_q - i0);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  int64_t kmax = 0;
  for (int64_t r = 0; r < bq; ++r) {
    t.visible[r] = mask.visible(b, i0 + r);
    kmax = std::max(kmax, t.visible[r]);
    t.m[r] = neg_inf;
    t.l[r] = 0;
  }
  T* o = out + (bh * d.n_q + i0) * d.value_dim;  // bq rows of the output, used as accumulator
  for (int64_t j0 = 0; j0 < kmax; j0 += kBlockK) {
    interruption_point();
    const int64_t bk = std::min(kBlockK, kmax - j0);
    matmul<T>(mat(t.s.data(), bq, bk, kBlockK), mat(q.row(bh, i0), bq, d.head_dim),
              mat(k.row(bh, j0), bk, d.head_dim).t(), scale);
    for (int64_t r = 0; r < bq; ++r) {
      T* srow = t.s.data() + r * kBlockK;
      const int64_t c = std::clamp<int64_t>(t.visible[r] - j0, 0, bk);
      for (int64_t j = c; j < bk; ++j) srow[j] = 0;  // masked keys: probability 0
      if (c == 0) continue;
      const T mx = simd::max_value(srow, static_cast<size_t>(c));
      require(std::isfinite(mx), "softmax_attention: q·kᵀ·scale overflows at row ", i0 + r,
              " of batch·head ", bh, "; scale down q or k");
      const T m_new = std::max(t.m[r], mx);
      const T sum = simd::exp_shifted_sum(srow, static_cast<size_t>(c), m_new);
      if (m_new != t.m[r]) {
        const T corr = std::exp(t.m[r] - m_new);  // 0 on the first visible block
        t.l[r] *= corr;
        simd::scale(o + r * d.value_dim, static_cast<size_t>(d.value_dim), corr);
        t.m[r] = m_new;
      }
      t.l[r] += sum;
    }
    matmul<T>(mat(o, bq, d.value_dim), mat(t.s.data(), bq, bk, kBlockK),
              mat(v.row(bh, j0), bk, d.value_dim), T(1), T(1));
  }
  for (int64_t r = 0; r < bq; ++r) {
    T* orow = o + r * d.value_dim;
    if (t.l[r] > 0) {
      simd::scale(orow, static_cast<size_t>(d.value_dim), T(1) / t.l[r]);
      lse[bh * d.n_q + i0 + r] = t.m[r] + std::log(t.l[r]);
    } else {
      for (int64_t c = 0; c < d.value_dim; ++c) orow[c] = 0;
      lse[bh * d.n_q + i0 + r] = neg_inf;
    }
  }
}

}  // namespace

namespace softmax_detail {

template <class T>
SoftmaxAttentionResult<T> forward(TensorView<const T> q, TensorView<const T> k,
                                  TensorView<const T> v, const AttentionDims& d,
                                  const AttentionOptions& opts, double scale, bool as_workspace) {
  if constexpr (std::is_same_v<T, float>) {
    return forward_f32(q, k, v, d, opts, scale, as_workspace);
  } else {
    SoftmaxAttentionResult<T> r{Tensor<T>({d.batch, d.heads, d.n_q, d.value_dim}, as_workspace),
                                Tensor<T>({d.batch, d.heads, d.n_q}, as_workspace)};
    const KeyMask mask(d, opts);
    const int64_t q_blocks = (d.n_q + kBlockQ - 1) / kBlockQ;
    T* out = r.out.data();
    T* lse = r.lse.data();
    const ParallelLoop loop(d.bh() * q_blocks);
    PerWorker<Tile<T>> tiles(loop);
    // Last query blocks first: under a causal mask they see the most keys.
    loop.run([&](int64_t task, int worker) {
      const int64_t bh = task / q_blocks;
      const int64_t blk = q_blocks - 1 - task % q_blocks;
      forward_block<T>(q, k, v, d, mask, static_cast<T>(scale), bh, blk * kBlockQ, tiles[worker],
                       out, lse);
    });
    return r;
  }
}

template SoftmaxAttentionResult<float> forward(TensorView<const float>, TensorView<const float>,
                                               TensorView<const float>, const AttentionDims&,
                                               const AttentionOptions&, double, bool);
template SoftmaxAttentionResult<double> forward(TensorView<const double>,
                                                TensorView<const double>,
                                                TensorView<const double>, const AttentionDims&,
                                                const AttentionOptions&, double, bool);
}  // namespace softmax_detail

template <class T>
SoftmaxAttentionResult<T> softmax_attention(TensorView<const T> q, TensorView<const T> k,
                                            TensorView<const T> v, const AttentionOptions& opts) {
  const char* fn = "softmax_attention";
  const AttentionDims d = check_attention_args(fn, q, k, v, opts);
  const double scale = resolve_scale(fn, opts, d.head_dim);
  const ValueScale<T> vs(v, d.v_max);  // out is linear in v, lse does not depend on it (range.h)
  SoftmaxAttentionResult<T> r = softmax_detail::forward(q, k, vs.view(), d, opts, scale, false);
  vs.restore(r.out);
  check_result_finite(fn, "the output", r.out);
  return r;
}

template SoftmaxAttentionResult<float> softmax_attention(TensorView<const float>,
                                                         TensorView<const float>,
                                                         TensorView<const float>,
                                                         const AttentionOptions&);
template SoftmaxAttentionResult<double> softmax_attention(TensorView<const double>,
                                                          TensorView<const double>,
                                                          TensorView<const double>,
                                                          const AttentionOptions&);

}  // namespace linattn
