// Exact attention backward in float32 on linattn's own product kernels (tile_matmul.h), in
// backward.cc's FlashAttention-2 order. Per (batch·head, block of keys), over the query blocks
// that see it:
//   P  = exp(post·(pre·Q)·Kᵀ − lse)                   recompute p_ij (scale = pre·post, as forward_f32)
//   dVᵀ += dOᵀ·P                                       from out_i = Σ_j p_ij v_j
//   dP = dO·Vᵀ;  dS = P∘(dP − δ), δ_i = dout_i·out_i   softmax backward
//   dKᵀ += (pre·Q)ᵀ·dS;  dQ += dS·K                    from s_ij = scale·q_i·k_j (post, scale at the end)
// dK and dV are summed transposed so that every product reads its left operand as plain rows
// (Qᵀ, dOᵀ, copied once per call) and its right operand as rows too (P, dS as they are made;
// Kᵀ, Vᵀ copied once per call): tile_matmul's B is row-major, and nothing is transposed inside
// the loop. Why not the BLAS: as for the forward (forward_f32.cc), its speed followed
// OPENBLAS_CORETYPE, and it packed every operand again on every one of these small products.
// Same error bounds as the BLAS path (tests/softmax_bounds.h): each product element is one chain
// of multiply-adds (tile_matmul.h). Extra memory: the copies (n_q·(2d + d_v) + n_k·(d + d_v) floats per batch·head, and K
// padded to 16 columns when d is not a multiple of 16), δ, the dQ sums and per-worker tiles.
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

constexpr int64_t kBlockQ = kBackwardBlockQ, kBlockK = kBackwardBlockK;

// The inputs in the layouts the products read, for all batch·heads, made once per call.
struct Operands {
  int64_t d_pad, nq_pad, nk_pad;  // head_dim to 16 columns; positions to 16
  float pre, post;                // scale = pre·post (ScaleSplit)
  int64_t q_bh, q_t_bh, do_t_bh, k_t_bh, v_t_bh, k_rows_bh;
  Buffer<float> q, q_t, do_t, k_t, v_t, k_rows;  // k_rows empty when K is read in place

  Operands(const AttentionDims& d, double scale)
      : d_pad(round_up(d.head_dim, 16)),
        nq_pad(round_up(d.n_q, 16)),
        nk_pad(round_up(d.n_k, 16)),
        q_bh(d.n_q * d.head_dim),
        q_t_bh(d.head_dim * nq_pad),
        do_t_bh(d.value_dim * nq_pad),
        k_t_bh(d.head_dim * nk_pad),
        v_t_bh(d.value_dim * nk_pad),
        k_rows_bh(d.head_dim % 16 ? d.n_k * d_pad : 0),
        q(d.bh() * q_bh),
        q_t(d.bh() * q_t_bh),
        do_t(d.bh() * do_t_bh),
        k_t(d.bh() * k_t_bh),
        v_t(d.bh() * v_t_bh),
        k_rows(d.bh() * k_rows_bh) {
    const ScaleSplit s(d, scale);
    pre = s.pre;
    post = s.post;
  }
};


struct Scratch {
  Buffer<float> p{kBlockQ * kBlockK};
  Buffer<float> ds{kBlockQ * kBlockK};  // dP, then dS in place
  Buffer<float> dkt, dvt;               // d × kBlockK, d_v × kBlockK
  explicit Scratch(const AttentionDims& d) : dkt(d.head_dim * kBlockK), dvt(d.value_dim * kBlockK) {}
};

struct Args {
  const Operands* ops;
  const AttentionDims* d;
  const KeyMask* mask;
  TensorView<const float> k, dout;
  const float* lse;
  const float* delta;
};

// dK, dV for keys [j_begin, j_end) of one batch·head; dQ sums (unscaled, d_pad columns per row)
// into dq.
void backward_keys(const Args& a, int64_t bh, int64_t j_begin, int64_t j_end, Scratch& w, float* dq, float* dk,
                   float* dv) {
  const Operands& o = *a.ops;
  const AttentionDims& d = *a.d;
  const int64_t b = bh / d.heads, key_len = a.mask->key_length(b);
  const float* q = o.q.data() + bh * o.q_bh;
  const float* q_t = o.q_t.data() + bh * o.q_t_bh;
  const float* do_t = o.do_t.data() + bh * o.do_t_bh;
  const float* k_t = o.k_t.data() + bh * o.k_t_bh;
  const float* v_t = o.v_t.data() + bh * o.v_t_bh;
  const float* k_rows = o.k_rows.size() ? o.k_rows.data() + bh * o.k_rows_bh : a.k.row(bh, 0);
  for (int64_t j0 = j_begin; j0 < std::min(j_end, key_len); j0 += kBlockK) {
    interruption_point();
    const int64_t bk = std::min({kBlockK, j_end - j0, key_len - j0});
    const int64_t cols = round_up(bk, 16);  // columns past bk: zero keys, probability 0
    std::fill_n(w.dkt.data(), w.dkt.size(), 0.0f);
    std::fill_n(w.dvt.data(), w.dvt.size(), 0.0f);
    // First query that sees key j0: visible(b, i) is non-decreasing in i.
    const int64_t i_start = a.mask->causal() ? std::max<int64_t>(0, j0 - (d.n_k - d.n_q)) : 0;
    for (int64_t i0 = i_start; i0 < d.n_q; i0 += kBlockQ) {
      interruption_point();
      const int64_t bq = std::min(kBlockQ, d.n_q - i0);
      // P = exp(post·S − lse), zero where masked.
      tile_matmul::multiply(q + i0 * d.head_dim, d.head_dim, bq, k_t + j0, o.nk_pad, d.head_dim, cols, w.p.data(),
                            kBlockK, false);
      for (int64_t r = 0; r < bq; ++r) {
        float* prow = w.p.data() + r * kBlockK;
        const float lse = a.lse[bh * d.n_q + i0 + r];
        const int64_t c = std::isfinite(lse) ? std::clamp<int64_t>(a.mask->visible(b, i0 + r) - j0, 0, bk) : 0;
        if (c > 0) {
          if (o.post != 1.0f) simd::scale(prow, static_cast<size_t>(c), o.post);
          simd::exp_shifted_sum(prow, static_cast<size_t>(c), lse);
        }
        std::fill(prow + c, prow + cols, 0.0f);
      }
      // dVᵀ += dOᵀ·P
      tile_matmul::multiply(do_t + i0, o.nq_pad, d.value_dim, w.p.data(), kBlockK, bq, cols, w.dvt.data(), kBlockK,
                            true);
      // dS = P∘(dO·Vᵀ − δ)
      tile_matmul::multiply(a.dout.row(bh, i0), d.value_dim, bq, v_t + j0, o.nk_pad, d.value_dim, cols, w.ds.data(),
                            kBlockK, false);
      for (int64_t r = 0; r < bq; ++r)
        simd::softmax_grad(w.ds.data() + r * kBlockK, w.p.data() + r * kBlockK, w.ds.data() + r * kBlockK,
                           static_cast<size_t>(cols), a.delta[bh * d.n_q + i0 + r]);
      // dKᵀ += (pre·Q)ᵀ·dS;  dQ += dS·K
      tile_matmul::multiply(q_t + i0, o.nq_pad, d.head_dim, w.ds.data(), kBlockK, bq, cols, w.dkt.data(), kBlockK,
                            true);
      tile_matmul::multiply(w.ds.data(), kBlockK, bq, k_rows + j0 * o.d_pad, o.d_pad, bk, o.d_pad,
                            dq + i0 * o.d_pad, o.d_pad, true);
    }
    store_key_gradients(w.dkt.data(), w.dvt.data(), kBlockK, o.post, d, bh, j0, bk, dk, dv);
  }
}

}  // namespace

AttentionGrads<float> backward_f32(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                                   TensorView<const float> dout, TensorView<const float> out,
                                   TensorView<const float> lse, const AttentionDims& d, const AttentionOptions& opts,
                                   double scale) {
  AttentionGrads<float> g{Tensor<float>(q.shape), Tensor<float>(k.shape), Tensor<float>(v.shape), {}};
  if (d.bh() == 0) return g;
  const KeyMask mask(d, opts);
  Operands o(d, scale);
  Buffer<float> delta(d.bh() * d.n_q);
  parallel_for(d.bh(), [&](int64_t bh) {
    const int64_t n_k = mask.key_length(bh / d.heads);  // keys past it are never read
    const float* qb = q.row(bh, 0);
    float* q_scaled = o.q.data() + bh * o.q_bh;
    for (int64_t x = 0; x < o.q_bh; ++x) q_scaled[x] = o.pre * qb[x];
    transpose_rows(q_scaled, d.n_q, d.head_dim, o.nq_pad, o.q_t.data() + bh * o.q_t_bh);
    transpose_rows(dout.row(bh, 0), d.n_q, d.value_dim, o.nq_pad, o.do_t.data() + bh * o.do_t_bh);
    transpose_rows(k.row(bh, 0), n_k, d.head_dim, o.nk_pad, o.k_t.data() + bh * o.k_t_bh);
    transpose_rows(v.row(bh, 0), n_k, d.value_dim, o.nk_pad, o.v_t.data() + bh * o.v_t_bh);
    if (o.k_rows.size()) pad_rows(k.row(bh, 0), n_k, d.head_dim, o.d_pad, o.k_rows.data() + bh * o.k_rows_bh);
    // δ_i = dout_i · out_i = Σ_j p_ij dp_ij
    for (int64_t i = 0; i < d.n_q; ++i)
      delta[bh * d.n_q + i] = simd::dot(dout.row(bh, i), out.row(bh, i), static_cast<size_t>(d.value_dim));
  });

  const KeySplits keys(d, kBlockK, num_threads());
  const int64_t splits = keys.splits, dq_per_bh = d.n_q * o.d_pad;
  Buffer<float> dq_sums(splits * d.bh() * dq_per_bh);
  const Args args{&o, &d, &mask, k, dout, lse.data, delta.data()};
  const ParallelLoop loop(d.bh() * splits);
  PerWorker<Scratch> scratch(loop, [&] { return Scratch(d); });
  loop.run([&](int64_t task, int worker) {
    const int64_t bh = task / splits, s = task % splits;
    backward_keys(args, bh, keys.begin(s), keys.end(s), scratch[worker], dq_sums.data() + (s * d.bh() + bh) * dq_per_bh,
                  g.dk.data(), g.dv.data());
  });
  add_dq_sums(dq_sums.data(), splits, o.d_pad, d, static_cast<float>(scale), g.dq.data());
  return g;
}

void store_key_gradients(const float* dkt, const float* dvt, int64_t ld, float dk_factor, const AttentionDims& d,
                         int64_t bh, int64_t j0, int64_t keys, float* dk, float* dv) {
  for (int64_t j = 0; j < keys; ++j) {
    float* dk_row = dk + (bh * d.n_k + j0 + j) * d.head_dim;
    float* dv_row = dv + (bh * d.n_k + j0 + j) * d.value_dim;
    for (int64_t f = 0; f < d.head_dim; ++f) dk_row[f] = dk_factor * dkt[f * ld + j];
    for (int64_t c = 0; c < d.value_dim; ++c) dv_row[c] = dvt[c * ld + j];
  }
}

void add_dq_sums(const float* sums, int64_t splits, int64_t ld, const AttentionDims& d, float scale, float* dq) {
  const int64_t per_bh = d.n_q * ld;
  parallel_for(d.bh(), [&](int64_t bh) {
    for (int64_t i = 0; i < d.n_q; ++i) {
      float* dst = dq + (bh * d.n_q + i) * d.head_dim;
      for (int64_t s = 0; s < splits; ++s) {
        const float* src = sums + (s * d.bh() + bh) * per_bh + i * ld;
        for (int64_t f = 0; f < d.head_dim; ++f) dst[f] += src[f];
      }
      simd::scale(dst, static_cast<size_t>(d.head_dim), scale);
    }
  });
}

}  // namespace linattn::softmax_detail
