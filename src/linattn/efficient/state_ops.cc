// Efficient Attention's state-level operations (include/linattn/efficient.h), per (batch, head):
//   key state:  e = exp(s·K_L − c) [L, d] with c the column maxima (softmax_columns' own),
//               S = eᵀ V_L, z = column sums of e;
//   apply:      G = diag(1/z)·S, out = ρ G with ρ = softmax over features of s·Q (blocks of rows).
// Backward (c held constant):
//   key state:  dv_L = e·dS, dk_L = s·e∘(V_L dSᵀ + 1·dzᵀ);
//   apply:      dG = Σ_blk ρᵀ dout, dq = s·softmax'(ρ, dout Gᵀ), dS_r = dG_r / z_r,
//               dz_r = −dG_r·G_r / z_r (both 0 where z_r = 0).
#include <algorithm>
#include <cmath>
#include <limits>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/core/row_softmax.h"
#include "linattn/core/simd.h"
#include "linattn/efficient.h"
#include "linattn/efficient/internal.h"

namespace linattn {
namespace {

template <class T>
void check_rank4(const char* fn, const char* name, TensorView<const T> x, const char* layout) {
  require(x.shape.size() == 4, fn, ": ", name, " must be ", layout, ", got shape ", shape_string(x.shape));
}

// The checks of a call on keys (k, v) or on queries (q; d_v from the state): the usual
// attention checks with the other side empty.
template <class T>
efficient::Setup check_keys(const char* fn, TensorView<const T> k, TensorView<const T> v,
                            const EfficientAttentionOptions& opts) {
  check_rank4(fn, "k", k, "[batch, heads, n, head_dim]");
  const TensorView<const T> no_queries{nullptr, {k.dim(0), k.dim(1), 0, k.dim(3)}};
  return efficient::check_args(fn, no_queries, k, v, opts);
}

template <class T>
efficient::Setup check_queries(const char* fn, TensorView<const T> q, TensorView<const T> state,
                               const EfficientAttentionOptions& opts) {
  check_rank4(fn, "q", q, "[batch, heads, n, head_dim]");
  check_rank4(fn, "state", state, "[batch, heads, head_dim, value_dim + 2]");
  require(!opts.key_lengths, fn, ": key_lengths is not taken here: the state holds the valid keys");
  const int64_t dv = state.dim(3) - 2;
  require(dv >= 1, fn, ": state must be [batch, heads, head_dim, value_dim + 2] with value_dim >= 1, got shape ",
          shape_string(state.shape));
  const TensorView<const T> no_keys{nullptr, {q.dim(0), q.dim(1), 0, q.dim(3)}};
  const TensorView<const T> no_values{nullptr, {q.dim(0), q.dim(1), 0, dv}};
  return efficient::check_args(fn, q, no_keys, no_values, opts);
}

// [B,H,d,d_v+2] of a call's sizes.
Shape state_shape(const AttentionDims& d) { return {d.batch, d.heads, d.head_dim, d.value_dim + 2}; }

// A state: its shape, S and z finite, z >= 0, and c finite or −inf with S = z = 0 in its row.
template <class T>
void check_state(const char* fn, const char* name, TensorView<const T> state, const AttentionDims& d) {
  require(state.shape == state_shape(d), fn, ": ", name, " has shape ", shape_string(state.shape), "; expected ",
          shape_string(state_shape(d)), " [batch, heads, head_dim, value_dim + 2] (an efficient_key_state)");
  const int64_t row = d.value_dim + 2;
  for (int64_t at = 0; at < state.size(); at += row) {
    const T* x = state.data + at;
    for (int64_t c = 0; c + 1 < row; ++c)
      require(std::isfinite(x[c]), fn, ": ", name, "[", at + c, "] = ", x[c], "; expected a finite value");
    require(x[row - 2] >= 0, fn, ": ", name, "[", at + row - 2, "] = ", x[row - 2], " is a sum of exponentials; expected >= 0");
    if (x[row - 2] == 0)
      for (int64_t c = 0; c + 2 < row; ++c)
        require(x[c] == 0, fn, ": ", name, "[", at + c, "] = ", x[c], " in a row whose sum z is 0 (no key); expected 0");
    const T shift = x[row - 1];
    require(std::isfinite(shift) || shift == -std::numeric_limits<T>::infinity(), fn, ": ", name, "[", at + row - 1,
            "] = ", shift, " is a shift; expected a finite value or -inf");
    if (std::isfinite(shift)) continue;
    for (int64_t c = 0; c + 1 < row; ++c)
      require(x[c] == 0, fn, ": ", name, "[", at + c, "] = ", x[c], " in a row whose shift is -inf (no key); expected 0");
  }
}

// e = exp(s·k_j − c) of head bh's first L keys into b.e, for the shifts c (L >= 1).
template <class T>
void key_exponentials(TensorView<const T> k, int64_t bh, int64_t L, int64_t hd, T scale, const T* c, efficient::Buffers<T>& b) {
  const T* x = k.row(bh, 0);
  for (int64_t i = 0; i < L * hd; ++i) b.e[i] = x[i] * scale;
  simd::exp_minus_columns(b.e.data(), static_cast<size_t>(L), static_cast<size_t>(hd), static_cast<size_t>(hd), c);
}

// G = S / z (rows with z = 0 give 0) of head bh's state rows into b.g.
template <class T>
void context(const T* st, int64_t hd, int64_t dv, efficient::Buffers<T>& b) {
  for (int64_t r = 0; r < hd; ++r) {
    const T* x = st + r * (dv + 2);
    const T z = x[dv];
    for (int64_t c = 0; c < dv; ++c) b.g[r * dv + c] = z > 0 ? x[c] / z : T(0);
  }
}

}  // namespace

template <class T>
Tensor<T> efficient_key_state(TensorView<const T> k, TensorView<const T> v, const EfficientAttentionOptions& opts) {
  const char* fn = "efficient_key_state";
  const efficient::Setup s = check_keys(fn, k, v, opts);
  const AttentionDims& d = s.d;
  const KeyMask mask(d, s.mask_opts);
  const int64_t hd = d.head_dim, dv = d.value_dim, row = dv + 2;
  Tensor<T> state(state_shape(d), false, Init::Uninitialized);
  const ParallelLoop loop(d.bh());
  PerWorker<efficient::Buffers<T>> buffers(loop, [&] { return efficient::Buffers<T>(s, false); });
  PerWorker<WrittenFinite> written(loop);
  const T sc = static_cast<T>(s.scale);
  loop.run([&](int64_t bh, int worker) {
    T* st = state.data() + bh * hd * row;
    const int64_t L = mask.key_length(bh / d.heads);
    if (L == 0) {
      for (int64_t r = 0; r < hd; ++r) {
        std::fill(st + r * row, st + r * row + dv + 1, T(0));
        st[r * row + dv + 1] = -std::numeric_limits<T>::infinity();
      }
      return;
    }
    efficient::Buffers<T>& b = buffers[worker];
    // e = exp(s·K − c) with c the column maxima (b.work[0, hd)), and b.inv the inverse sums.
    T* inv = b.inv.data();
    require(simd::softmax_columns(k.row(bh, 0), static_cast<size_t>(hd), b.e.data(), static_cast<size_t>(L),
                                  static_cast<size_t>(hd), sc, inv, b.work.data()),
            fn, ": s·k overflowed to inf or NaN; the inputs are too large for this dtype");
    for (int64_t r = 0; r < hd; ++r) {
      st[r * row + dv] = T(1) / inv[r];
      st[r * row + dv + 1] = b.work[r];
    }
    matmul<T>(mat(st, hd, dv, row), mat(b.e.data(), L, hd).t(), mat(v.row(bh, 0), L, dv));
    for (int64_t r = 0; r < hd; ++r) written[worker].check(st + r * row, dv + 1);  // S and z (c may be −inf)
  });
  require(all_written_finite(written), fn, ": the state overflows ", dtype_name<T>(),
          ": the inputs are finite but too large for this dtype; scale them down or use float64");
  return state;
}

template <class T>
StateGrads<T> efficient_key_state_backward(TensorView<const T> k, TensorView<const T> v, TensorView<const T> state,
                                           TensorView<const T> dstate, const EfficientAttentionOptions& opts) {
  const char* fn = "efficient_key_state_backward";
  const efficient::Setup s = check_keys(fn, k, v, opts);
  const AttentionDims& d = s.d;
  check_state(fn, "state", state, d);
  check_same_shape_finite(fn, "dstate", dstate, state_shape(d));
  const KeyMask mask(d, s.mask_opts);
  const int64_t hd = d.head_dim, dv = d.value_dim, row = dv + 2;
  StateGrads<T> g{{}, Tensor<T>(k.shape, false, Init::Uninitialized), Tensor<T>(v.shape, false, Init::Uninitialized), {}};
  const ParallelLoop loop(d.bh());
  PerWorker<efficient::Buffers<T>> buffers(loop, [&] { return efficient::Buffers<T>(s, true); });
  PerWorker<WrittenFinite> written(loop);
  const T sc = static_cast<T>(s.scale);
  loop.run([&](int64_t bh, int worker) {
    const int64_t L = mask.key_length(bh / d.heads);
    T* dk = g.dk.data() + bh * d.n_k * hd;
    T* dvo = g.dv.data() + bh * d.n_k * dv;
    std::fill(dk + L * hd, dk + d.n_k * hd, T(0));
    std::fill(dvo + L * dv, dvo + d.n_k * dv, T(0));
    if (L == 0) return;
    efficient::Buffers<T>& b = buffers[worker];
    const T* st = state.data + bh * hd * row;
    const T* gs = dstate.data + bh * hd * row;
    for (int64_t r = 0; r < hd; ++r) {
      b.work[r] = st[r * row + dv + 1];
      require(std::isfinite(b.work[r]), fn, ": state[", bh * hd * row + r * row + dv + 1, "] = ", b.work[r],
              " is the shift of a block with keys; expected the finite one efficient_key_state gave for these k");
    }
    key_exponentials(k, bh, L, hd, sc, b.work.data(), b);
    // dv_L = e·dS; dk_L = s·e∘(V_L dSᵀ + 1·dzᵀ)
    matmul<T>(mat(dvo, L, dv), mat(b.e.data(), L, hd), mat(gs, hd, dv, row));
    matmul<T>(mat(dk, L, hd), mat(v.row(bh, 0), L, dv), mat(gs, hd, dv, row).t());
    for (int64_t j = 0; j < L; ++j)
      for (int64_t r = 0; r < hd; ++r) dk[j * hd + r] = sc * b.e[j * hd + r] * (dk[j * hd + r] + gs[r * row + dv]);
    written[worker].check(dk, L * hd);
    written[worker].check(dvo, L * dv);
  });
  if (!all_written_finite(written)) {
    check_result_finite(fn, "dk", g.dk);
    check_result_finite(fn, "dv", g.dv);
  }
  return g;
}

template <class T>
Tensor<T> efficient_apply_state(TensorView<const T> q, TensorView<const T> state, const EfficientAttentionOptions& opts) {
  const char* fn = "efficient_apply_state";
  const efficient::Setup s = check_queries(fn, q, state, opts);
  const AttentionDims& d = s.d;
  check_state(fn, "state", state, d);
  const int64_t hd = d.head_dim, dv = d.value_dim;
  Tensor<T> out({d.batch, d.heads, d.n_q, dv}, false, Init::Uninitialized);
  const ParallelLoop loop(d.bh());
  PerWorker<efficient::Buffers<T>> buffers(loop, [&] { return efficient::Buffers<T>(s, false); });
  loop.run([&](int64_t bh, int worker) {
    efficient::Buffers<T>& b = buffers[worker];
    context(state.data + bh * hd * (dv + 2), hd, dv, b);
    for (int64_t r0 = 0; r0 < d.n_q; r0 += efficient::kRowBlock) {
      interruption_point();
      const int64_t rows = std::min(efficient::kRowBlock, d.n_q - r0);
      efficient::query_block(fn, s, q, bh, r0, rows, b);
      matmul<T>(mat(out.data() + (bh * d.n_q + r0) * dv, rows, dv), mat(b.qb.data(), rows, hd), mat(b.g.data(), hd, dv));
    }
  });
  check_result_finite(fn, "the output", out);
  return out;
}

template <class T>
StateGrads<T> efficient_apply_state_backward(TensorView<const T> q, TensorView<const T> state, TensorView<const T> dout,
                                             const EfficientAttentionOptions& opts) {
  const char* fn = "efficient_apply_state_backward";
  const efficient::Setup s = check_queries(fn, q, state, opts);
  const AttentionDims& d = s.d;
  check_state(fn, "state", state, d);
  check_same_shape_finite(fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  const int64_t hd = d.head_dim, dv = d.value_dim, row = dv + 2;
  StateGrads<T> g{Tensor<T>(q.shape, false, Init::Uninitialized), {}, {}, Tensor<T>(state.shape, false, Init::Uninitialized)};
  const ParallelLoop loop(d.bh());
  PerWorker<efficient::Buffers<T>> buffers(loop, [&] { return efficient::Buffers<T>(s, true); });
  PerWorker<WrittenFinite> written(loop);
  const T sc = static_cast<T>(s.scale);
  loop.run([&](int64_t bh, int worker) {
    efficient::Buffers<T>& b = buffers[worker];
    const T* st = state.data + bh * hd * row;
    context(st, hd, dv, b);
    std::fill(b.dg.data(), b.dg.data() + hd * dv, T(0));
    for (int64_t r0 = 0; r0 < d.n_q; r0 += efficient::kRowBlock) {
      interruption_point();
      const int64_t rows = std::min(efficient::kRowBlock, d.n_q - r0);
      const T* go = dout.data + (bh * d.n_q + r0) * dv;
      efficient::query_block(fn, s, q, bh, r0, rows, b);
      // out = ρ G: dG += ρᵀ dout, dρ = dout Gᵀ
      matmul<T>(mat(b.dg.data(), hd, dv), mat(b.qb.data(), rows, hd).t(), mat(go, rows, dv), T(1), T(1));
      matmul<T>(mat(b.dqb.data(), rows, hd), mat(go, rows, dv), mat(b.g.data(), hd, dv).t());
      softmax_rows_backward(b.qb.data(), b.dqb.data(), rows, hd, hd, hd);
      T* dq = g.dq.data() + (bh * d.n_q + r0) * hd;
      for (int64_t i = 0; i < rows * hd; ++i) dq[i] = sc * b.dqb[i];
      written[worker].check(dq, rows * hd);
    }
    // G_r = S_r / z_r: dS_r = dG_r / z_r, dz_r = −dG_r·G_r / z_r (0 where z_r = 0); c none.
    T* gs = g.dstate.data() + bh * hd * row;
    for (int64_t r = 0; r < hd; ++r) {
      const T z = st[r * row + dv];
      const T* dg = b.dg.data() + r * dv;
      for (int64_t c = 0; c < dv; ++c) gs[r * row + c] = z > 0 ? dg[c] / z : T(0);
      gs[r * row + dv] = z > 0 ? -simd::dot(dg, b.g.data() + r * dv, static_cast<size_t>(dv)) / z : T(0);
      gs[r * row + dv + 1] = 0;
    }
    written[worker].check(gs, hd * row);
  });
  if (!all_written_finite(written)) {
    check_result_finite(fn, "dq", g.dq);
    check_result_finite(fn, "dstate", g.dstate);
  }
  return g;
}

#define LINATTN_INSTANTIATE(T)                                                                                          \
  template Tensor<T> efficient_key_state(TensorView<const T>, TensorView<const T>, const EfficientAttentionOptions&);   \
  template StateGrads<T> efficient_key_state_backward(TensorView<const T>, TensorView<const T>, TensorView<const T>,     \
                                                      TensorView<const T>, const EfficientAttentionOptions&);          \
  template Tensor<T> efficient_apply_state(TensorView<const T>, TensorView<const T>, const EfficientAttentionOptions&); \
  template StateGrads<T> efficient_apply_state_backward(TensorView<const T>, TensorView<const T>, TensorView<const T>,   \
                                                        const EfficientAttentionOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
