// Exact attention backward for bfloat16 inputs with bfloat16 products summed in float32
// (AVX512-BF16's vdpbf16ps), in backward.cc's FlashAttention-2 order. Per (batch·head, block of
// keys), over the query blocks that see it:
//   P  = exp(scale·Q·Kᵀ − lse)                     float32, from bfloat16 products
//   dVᵀ += dOᵀ·bf16(P)                              from out_i = Σ_j p_ij v_j
//   dP = dO·Vᵀ;  dS = P∘(dP − δ), δ_i = dout_i·out_i (float32)
//   dKᵀ += Qᵀ·bf16(dS);  dQ += bf16(dS)·K          from s_ij = scale·q_i·k_j (scale at the end)
// dK and dV are accumulated transposed so that every product reads its left operand as plain
// rows (Qᵀ, dOᵀ are packed once per call) and its right operand in the pair layout that
// avx512_bf16::pack_pairs writes from P and dS directly: no transpose inside the loop.
//
// What it costs against the widened float32 backward (docs/precision.md): P and dS are rounded
// to bfloat16 before their products, a relative error ≤ u = 2⁻⁸ per term, and each gradient is
// rounded once at the end; the softmax statistics, δ and every sum stay float32.
#include <algorithm>
#include <cmath>
#include <limits>

#include "linattn/core/attention_args.h"
#include "linattn/core/avx512_bf16.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/simd.h"
#include "linattn/softmax/forward_internal.h"

namespace linattn::softmax_detail {
namespace {

constexpr int64_t kBlockQ = 128, kBlockK = 128;  // multiples of 32: whole chunks of pairs

// The inputs in the layouts the products read, for all batch·heads, made once per call.
struct Operands {
  int64_t d_pad, dv_pad;          // features padded to 32 (rows read as whole 16-pair chunks)
  int64_t nq_pad, nk_pad;         // positions padded to 32
  int64_t d_chunks, dv_chunks;    // 32-feature chunks of K and V as product columns
  int64_t d_blocks;               // 16-column blocks of dQ = dS·K
  int64_t q_rows_bh, q_t_bh, do_rows_bh, do_t_bh, k_cols_bh, v_cols_bh, k_pairs_bh;
  Buffer<bfloat16> q_rows, q_t, do_rows, do_t, k_cols, v_cols, k_pairs;

  explicit Operands(const AttentionDims& d)
      : d_pad(round_up(d.head_dim, kTileDepth)),
        dv_pad(round_up(d.value_dim, kTileDepth)),
        nq_pad(round_up(d.n_q, kTileDepth)),
        nk_pad(round_up(d.n_k, kTileDepth)),
        d_chunks(d_pad / kTileDepth),
        dv_chunks(dv_pad / kTileDepth),
        d_blocks((d.head_dim + kTileRows - 1) / kTileRows),
        q_rows_bh(d.n_q * d_pad),
        q_t_bh(d.head_dim * nq_pad),
        do_rows_bh(d.n_q * dv_pad),
        do_t_bh(d.value_dim * nq_pad),
        k_cols_bh(nk_pad * d_pad),
        v_cols_bh(nk_pad * dv_pad),
        k_pairs_bh(nk_pad * d_blocks * kTileRows),
        q_rows(d.bh() * q_rows_bh),
        q_t(d.bh() * q_t_bh),
        do_rows(d.bh() * do_rows_bh),
        do_t(d.bh() * do_t_bh),
        k_cols(d.bh() * k_cols_bh),
        v_cols(d.bh() * v_cols_bh),
        k_pairs(d.bh() * k_pairs_bh) {}
};


struct Scratch {
  Buffer<float> p{kBlockQ * kBlockK};
  Buffer<float> ds{kBlockQ * kBlockK};  // dP, then dS in place
  Buffer<bfloat16> p_pairs{kBlockQ * kBlockK}, ds_pairs{kBlockQ * kBlockK}, ds_rows{kBlockQ * kBlockK};
  Buffer<float> dkt, dvt;  // d × kBlockK, d_v × kBlockK
  explicit Scratch(const AttentionDims& d) : dkt(d.head_dim * kBlockK), dvt(d.value_dim * kBlockK) {}
};

struct Args {
  const Operands* ops;
  const AttentionDims* d;
  const KeyMask* mask;
  const float* lse;
  const float* delta;
  float scale;
};

// dK, dV (float32, scaled) for keys [j_begin, j_end) of one batch·head; dQ sums (unscaled,
// d_blocks·16 columns per row) into dq.
void backward_keys(const Args& a, int64_t bh, int64_t j_begin, int64_t j_end, Scratch& w, float* dq, float* dk,
                   float* dv) {
  const Operands& o = *a.ops;
  const AttentionDims& d = *a.d;
  const int64_t b = bh / d.heads, key_len = a.mask->key_length(b);
  const bfloat16* q_rows = o.q_rows.data() + bh * o.q_rows_bh;
  const bfloat16* q_t = o.q_t.data() + bh * o.q_t_bh;
  const bfloat16* do_rows = o.do_rows.data() + bh * o.do_rows_bh;
  const bfloat16* do_t = o.do_t.data() + bh * o.do_t_bh;
  const int64_t k_tile = o.d_chunks * kTileElems, v_tile = o.dv_chunks * kTileElems;  // 16 keys
  const int64_t k_chunk = o.d_blocks * kTileElems;                                     // 32 keys
  for (int64_t j0 = j_begin; j0 < std::min(j_end, key_len); j0 += kBlockK) {
    interruption_point();
    const int64_t bk = std::min({kBlockK, j_end - j0, key_len - j0});
    const int64_t cols = (bk + kTileRows - 1) / kTileRows, bk32 = round_up(bk, kTileDepth);
    const avx512_bf16::PackedB k_cols{o.k_cols.data() + bh * o.k_cols_bh + (j0 / kTileRows) * k_tile, k_tile,
                                      kTileElems};
    const avx512_bf16::PackedB v_cols{o.v_cols.data() + bh * o.v_cols_bh + (j0 / kTileRows) * v_tile, v_tile,
                                      kTileElems};
    const avx512_bf16::PackedB k_pairs{o.k_pairs.data() + bh * o.k_pairs_bh + (j0 / kTileDepth) * k_chunk, kTileElems,
                                       k_chunk};
    const avx512_bf16::PackedB p_pairs{w.p_pairs.data(), kTileElems, cols * kTileElems};
    const avx512_bf16::PackedB ds_pairs{w.ds_pairs.data(), kTileElems, cols * kTileElems};
    std::fill_n(w.dkt.data(), w.dkt.size(), 0.0f);
    std::fill_n(w.dvt.data(), w.dvt.size(), 0.0f);
    // First query that sees key j0: visible(b, i) is non-decreasing in i.
    const int64_t i_start = a.mask->causal() ? std::max<int64_t>(0, j0 - (d.n_k - d.n_q)) / kBlockQ * kBlockQ : 0;
    for (int64_t i0 = i_start; i0 < d.n_q; i0 += kBlockQ) {
      interruption_point();
      const int64_t bq = std::min(kBlockQ, d.n_q - i0), pairs_q = (bq + 1) / 2;
      // P = exp(scale·Q·Kᵀ − lse), zero where masked.
      avx512_bf16::dot(q_rows + i0 * o.d_pad, o.d_pad, bq, k_cols, o.d_pad / 2, cols, w.p.data(), kBlockK, false);
      for (int64_t r = 0; r < bq; ++r) {
        float* prow = w.p.data() + r * kBlockK;
        const float lse = a.lse[bh * d.n_q + i0 + r];
        const int64_t c = std::isfinite(lse) ? std::clamp<int64_t>(a.mask->visible(b, i0 + r) - j0, 0, bk) : 0;
        if (c > 0) {
          simd::scale(prow, static_cast<size_t>(c), a.scale);
          simd::exp_shifted_sum(prow, static_cast<size_t>(c), lse);
        }
        std::fill(prow + c, prow + cols * kTileRows, 0.0f);
      }
      // dVᵀ += dOᵀ·P
      avx512_bf16::pack_pairs(w.p.data(), kBlockK, bq, cols, pairs_q, w.p_pairs.data());
      avx512_bf16::dot(do_t + i0, o.nq_pad, d.value_dim, p_pairs, pairs_q, cols, w.dvt.data(), kBlockK, true);
      // dS = P∘(dO·Vᵀ − δ)
      avx512_bf16::dot(do_rows + i0 * o.dv_pad, o.dv_pad, bq, v_cols, o.dv_pad / 2, cols, w.ds.data(), kBlockK, false);
      for (int64_t r = 0; r < bq; ++r) {
        float* dsrow = w.ds.data() + r * kBlockK;
        simd::softmax_grad(dsrow, w.p.data() + r * kBlockK, dsrow, static_cast<size_t>(cols * kTileRows),
                           a.delta[bh * d.n_q + i0 + r]);
        bfloat16* out_row = w.ds_rows.data() + r * kBlockK;
        simd::narrow(dsrow, out_row, static_cast<size_t>(cols * kTileRows));
        std::fill(out_row + cols * kTileRows, out_row + bk32, bfloat16{0});
      }
      // dKᵀ += Qᵀ·dS;  dQ += dS·K
      avx512_bf16::pack_pairs(w.ds.data(), kBlockK, bq, cols, pairs_q, w.ds_pairs.data());
      avx512_bf16::dot(q_t + i0, o.nq_pad, d.head_dim, ds_pairs, pairs_q, cols, w.dkt.data(), kBlockK, true);
      avx512_bf16::dot(w.ds_rows.data(), kBlockK, bq, k_pairs, bk32 / 2, o.d_blocks, dq + i0 * o.d_blocks * kTileRows,
                       o.d_blocks * kTileRows, true);
    }
    store_key_gradients(w.dkt.data(), w.dvt.data(), kBlockK, a.scale, d, bh, j0, bk, dk, dv);
  }
}

}  // namespace

bool bf16_backward_usable(const AttentionDims& d, double scale, double dout_max) {
  // Every float32 sum below stays under 2^120 (the widened backward rescales v and dout by
  // powers of two first, range.h, and applies the scale inside its products, so it takes the
  // rest): S = Q·Kᵀ ≤ d·|q|·|k|; dP and δ ≤ d_v·|v|·|dout|, so |dS| ≤ 2·d_v·|v|·|dout|;
  // dKᵀ ≤ n_q·|dS|·|q|, dQ ≤ n_k·|dS|·|k|, dVᵀ ≤ n_q·|dout| (P ≤ 1).
  const double limit = 0x1p120, dv = static_cast<double>(d.value_dim);
  const double ds = 2 * dv * d.v_max * dout_max;
  return avx512_bf16::usable() && scale > 0 && d.v_max <= 0x1p48 && dout_max <= 0x1p48 &&
         static_cast<double>(d.head_dim) * d.q_max * d.k_max <= limit &&
         static_cast<double>(d.n_q) * ds * d.q_max <= limit && static_cast<double>(d.n_k) * ds * d.k_max <= limit &&
         static_cast<double>(d.n_q) * dout_max <= limit;
}

AttentionGrads<float> backward_bf16_products(TensorView<const bfloat16> q, TensorView<const bfloat16> k,
                                             TensorView<const bfloat16> v, TensorView<const bfloat16> dout,
                                             TensorView<const float> out, TensorView<const float> lse,
                                             const AttentionDims& d, const AttentionOptions& opts, double scale) {
  AttentionGrads<float> g{Tensor<float>(q.shape), Tensor<float>(k.shape), Tensor<float>(v.shape), {}};
  if (d.bh() == 0) return g;
  const KeyMask mask(d, opts);
  Operands o(d);
  Buffer<float> delta(d.bh() * d.n_q);
  parallel_for(d.bh(), [&](int64_t bh) {
    const int64_t n_k = mask.key_length(bh / d.heads);  // keys past it are never read
    pad_rows(q.row(bh, 0), d.n_q, d.head_dim, o.d_pad, o.q_rows.data() + bh * o.q_rows_bh);
    transpose_rows(q.row(bh, 0), d.n_q, d.head_dim, o.nq_pad, o.q_t.data() + bh * o.q_t_bh);
    pad_rows(dout.row(bh, 0), d.n_q, d.value_dim, o.dv_pad, o.do_rows.data() + bh * o.do_rows_bh);
    transpose_rows(dout.row(bh, 0), d.n_q, d.value_dim, o.nq_pad, o.do_t.data() + bh * o.do_t_bh);
    tile_keys(k.row(bh, 0), n_k, d.head_dim, o.d_chunks, o.k_cols.data() + bh * o.k_cols_bh);
    tile_keys(v.row(bh, 0), n_k, d.value_dim, o.dv_chunks, o.v_cols.data() + bh * o.v_cols_bh);
    tile_values(k.row(bh, 0), n_k, d.head_dim, o.d_blocks, o.k_pairs.data() + bh * o.k_pairs_bh);
    // δ_i = dout_i · out_i = Σ_j p_ij dp_ij, in float32 from the widened dout.
    Buffer<float> row(d.value_dim, /*counted=*/false, Init::Uninitialized);
    for (int64_t i = 0; i < d.n_q; ++i) {
      simd::widen(dout.row(bh, i), row.data(), static_cast<size_t>(d.value_dim));
      delta[bh * d.n_q + i] = simd::dot(row.data(), out.row(bh, i), static_cast<size_t>(d.value_dim));
    }
  });

  const KeySplits keys(d, kBlockK, num_threads());
  const int64_t splits = keys.splits;
  const int64_t dq_ld = o.d_blocks * kTileRows, dq_per_bh = d.n_q * dq_ld;
  Buffer<float> dq_sums(splits * d.bh() * dq_per_bh);
  const Args args{&o, &d, &mask, lse.data, delta.data(), static_cast<float>(scale)};
  const ParallelLoop loop(d.bh() * splits);
  PerWorker<Scratch> scratch(loop, [&] { return Scratch(d); });
  loop.run([&](int64_t task, int worker) {
    const int64_t bh = task / splits, s = task % splits;
    backward_keys(args, bh, keys.begin(s), keys.end(s), scratch[worker], dq_sums.data() + (s * d.bh() + bh) * dq_per_bh,
                  g.dk.data(), g.dv.data());
  });
  add_dq_sums(dq_sums.data(), splits, dq_ld, d, static_cast<float>(scale), g.dq.data());
  return g;
}

}  // namespace linattn::softmax_detail
