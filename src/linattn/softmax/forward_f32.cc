// Exact attention forward in float32 on linattn's own Highway product kernels (tile_matmul.h),
// FlashAttention-style. Per (batch·head, block of kRows queries), over blocks of kKeys keys:
//   S = (scale·Q)·Kᵀ                   (tile_matmul, B = the packed Kᵀ panels)
//   m' = max(m, rowmax S); P = exp(S − m'), in place of S; l = l·exp(m − m') + rowsum P
//   O = O·exp(m − m') + P·V            (tile_matmul, B = V's rows as they are)
// then out = O / l and lse = m + log l.
//
// Why not the BLAS (forward.cc, which float64 still takes): OpenBLAS repacks Q, K and V on every
// one of these small products and picks its kernel from OPENBLAS_CORETYPE; here Kᵀ is packed once
// per call into panels of kPanel keys ([d][kPanel] each, the row-major B of S's product), V is
// read in place (copied only when d_v is not a multiple of 16), and the scaled queries once per
// task. Same error bound as the BLAS path (tests/softmax_bounds.h): each score is one chain of
// multiply-adds over d of the rounded scale·q (within γ_{d+2} with the scale's own rounding),
// each output column one chain over the keys.
// Extra memory: the packed keys (n_k·d, n_k rounded up to kPanel) and per worker
// kRows·(d + kKeys + d_v) floats.
#include <algorithm>
#include <cmath>
#include <limits>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/simd.h"
#include "linattn/core/tile_matmul.h"
#include "linattn/softmax/forward_internal.h"

namespace linattn::softmax_detail {
namespace {

constexpr int64_t kRows = 48;   // queries per task: eight 6-row register blocks
constexpr int64_t kKeys = 256;  // keys per online-softmax step
constexpr int64_t kPanel = 64;  // keys per packed panel of Kᵀ (one AVX-512 register block wide)

struct Scratch {
  Buffer<float> q;  // kRows × d: pre·q
  Buffer<float> s;  // kRows × kKeys: scores, then probabilities
  Buffer<float> o;  // kRows × v_pad: the output rows' running sums
  float m[kRows], l[kRows];
  int64_t visible[kRows];
  Scratch(int64_t d, int64_t v_pad) : q(kRows * d), s(kRows * kKeys), o(kRows * v_pad) {}
};

struct Layout {
  int64_t n_k_pad, v_pad;
  const float* values;  // V's rows for bh = 0, ld_v apart; batch·heads n_k·ld_v apart
  int64_t ld_v;
  float pre, post;  // scale = pre·post: q is multiplied by pre before the product, S by post after
};

void forward_rows(TensorView<const float> q, const float* keys, const AttentionDims& d, const Layout& lay,
                  const KeyMask& mask, int64_t bh, int64_t i0, Scratch& w, float* out, float* lse) {
  const int64_t b = bh / d.heads;
  const int64_t rows = std::min(kRows, d.n_q - i0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t kmax = 0;
  for (int64_t r = 0; r < rows; ++r) {
    w.visible[r] = mask.visible(b, i0 + r);
    kmax = std::max(kmax, w.visible[r]);
    w.m[r] = neg_inf;
    w.l[r] = 0;
  }
  const float* qrows = q.row(bh, i0);
  for (int64_t x = 0; x < rows * d.head_dim; ++x) w.q[x] = lay.pre * qrows[x];
  std::fill_n(w.o.data(), rows * lay.v_pad, 0.0f);
  const float* values = lay.values + bh * d.n_k * lay.ld_v;

  for (int64_t j0 = 0; j0 < kmax; j0 += kKeys) {
    interruption_point();
    const int64_t bk = std::min(kKeys, kmax - j0);
    const int64_t cols = round_up(bk, 16);  // keys past bk: zeros or masked, probability 0
    for (int64_t jj = 0; jj < cols; jj += kPanel) {
      const float* panel = keys + (j0 + jj) * d.head_dim;  // panels are kPanel·d floats apart
      tile_matmul::multiply(w.q.data(), d.head_dim, rows, panel, kPanel, d.head_dim, std::min(kPanel, cols - jj),
                            w.s.data() + jj, kKeys, false);
    }
    int64_t count[kRows];
    for (int64_t r = 0; r < rows; ++r) count[r] = std::clamp<int64_t>(w.visible[r] - j0, 0, bk);
    const int64_t bad = simd::online_softmax_step(w.s.data(), kKeys, static_cast<size_t>(rows), count,
                                                  static_cast<size_t>(cols), lay.post, w.m, w.l,
                                                  w.o.data(), static_cast<size_t>(lay.v_pad),
                                                  static_cast<size_t>(d.value_dim), w.s.data(), kKeys);
    require(bad < 0, "softmax_attention: q·kᵀ·scale overflows at row ", i0 + bad, " of batch·head ", bh,
            "; scale down q or k");
    tile_matmul::multiply(w.s.data(), kKeys, rows, values + j0 * lay.ld_v, lay.ld_v, bk, lay.v_pad, w.o.data(),
                          lay.v_pad, true);
  }
  const int64_t bad = simd::finish_rows(w.o.data(), static_cast<size_t>(lay.v_pad), static_cast<size_t>(rows),
                                        static_cast<size_t>(d.value_dim), w.l, out + (bh * d.n_q + i0) * d.value_dim,
                                        static_cast<size_t>(d.value_dim));
  require(bad < 0, "softmax_attention: the output has a non-finite value at row ", i0 + bad, " of batch·head ", bh);
  for (int64_t r = 0; r < rows; ++r) lse[bh * d.n_q + i0 + r] = w.l[r] > 0 ? w.m[r] + std::log(w.l[r]) : neg_inf;
}

}  // namespace

SoftmaxAttentionResult<float> forward_f32(TensorView<const float> q, TensorView<const float> k,
                                          TensorView<const float> v, const AttentionDims& d,
                                          const AttentionOptions& opts, double scale, bool as_workspace) {
  // Every row of out and lse is written below (rows without keys get zeros and −inf).
  SoftmaxAttentionResult<float> r{
      Tensor<float>({d.batch, d.heads, d.n_q, d.value_dim}, as_workspace, Init::Uninitialized),
      Tensor<float>({d.batch, d.heads, d.n_q}, as_workspace, Init::Uninitialized)};
  const KeyMask mask(d, opts);
  const ScaleSplit split(d, scale);
  Layout lay{round_up(d.n_k, kPanel), round_up(d.value_dim, 16), v.data, d.value_dim, split.pre, split.post};

  // Kᵀ in panels: panel t holds keys [t·kPanel, (t+1)·kPanel) as a d × kPanel row-major matrix.
  // Keys past a batch item's key_lengths are never read (they may hold anything, NaN included);
  // their columns stay zero and their probabilities are 0.
  Buffer<float> keys(d.bh() * lay.n_k_pad * d.head_dim);
  Buffer<float> values;
  if (d.value_dim % 16 != 0) values = Buffer<float>(d.bh() * d.n_k * lay.v_pad);
  parallel_for(d.bh(), [&](int64_t bh) {
    const int64_t n_k = mask.key_length(bh / d.heads);
    float* dst = keys.data() + bh * lay.n_k_pad * d.head_dim;
    for (int64_t j = 0; j < n_k; ++j) {
      const float* row = k.row(bh, j);
      float* col = dst + (j / kPanel) * kPanel * d.head_dim + j % kPanel;
      for (int64_t c = 0; c < d.head_dim; ++c) col[c * kPanel] = row[c];
    }
    if (values.size() > 0) pad_rows(v.row(bh, 0), n_k, d.value_dim, lay.v_pad, values.data() + bh * d.n_k * lay.v_pad);
  });
  if (values.size() > 0) {
    lay.values = values.data();
    lay.ld_v = lay.v_pad;
  }

  const int64_t q_blocks = (d.n_q + kRows - 1) / kRows;
  const ParallelLoop loop(d.bh() * q_blocks);
  PerWorker<Scratch> scratch(loop, [&] { return Scratch(d.head_dim, lay.v_pad); });
  loop.run([&](int64_t task, int worker) {
    const int64_t bh = task / q_blocks;
    const int64_t blk = q_blocks - 1 - task % q_blocks;  // causal: the longest rows first
    forward_rows(q, keys.data() + bh * lay.n_k_pad * d.head_dim, d, lay, mask, bh, blk * kRows, scratch[worker],
                 r.out.data(), r.lse.data());
  });
  return r;
}

}  // namespace linattn::softmax_detail
