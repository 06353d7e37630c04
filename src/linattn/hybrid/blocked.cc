// The causal hybrid at BLAS speed (hybrid.cc's sweeps do one rank-one update per key): for
// n_q == n_k and features used as they are (elu, relu, focused, given), the two parts are split
// onto blocked engines.
// - Linear part. Row i holds the keys s <= j <= i − w, each weighed by e^{λ(i − j)}. Shifting
//   the keys and [v | 1] down by w rows (row t of the shifted sequence holds key t − w when it
//   is linear, else zeros) makes that the causal gated linear attention of the shifted
//   sequence, times e^{λw}: Σ_{t<=i} e^{λ(i − t)} φ(q_i)·φ(k'_t) [v'_t | 1], on the chunked
//   engine of gated.h (products of 64-row chunks), which gives num and den in one call.
// - Window part. Per tile of 64 queries, the scores against the keys any of them sees exactly
//   (the sinks, and the band from the tile's first window start to its last query) are two
//   products, masked per row to its sinks and window, e^{s − M_i}, and two more products with
//   the values (float32: on the library's tile kernels). Half the band is masked (a query sees
//   w of its 64 + w − 1 keys), which products do faster than one dot per key does the rest
//   (tiles of 32 rows, with a third fewer masked products, measured the same).
// Then out_i = (γ N_i + e^{λw} num_i) / (γ D_i + e^{λw} den_i + eps), as hybrid.cc.
// Backward: g_i = dout_i/B_i and c_i = −dout_i·out_i/B_i (B_i the denominator) are the
// gradients of the numerator and the denominator; the window's tile takes ds_ij = γ e_ij
// (g_i·v_j + c_i) (the shift M_i taking −Σ_j ds_ij at the row's first maximum), as products;
// the linear part's gradient is the gated engine's backward for dout' = e^{λw}[g_i | c_i],
// shifted back up by w rows and taken through the map.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/core/simd.h"
#include "linattn/core/tile_matmul.h"
#include "linattn/gated.h"
#include "linattn/hybrid/internal.h"
#include "linattn/memory.h"

namespace linattn::hybrid {

bool blocked_applies(const Setup& s) {
  return s.opts.causal && s.d.n_q == s.d.n_k && !s.favor();
}

namespace {

constexpr int64_t kTileRows = 64;

// The linear part's operands for the gated engine (the keys shifted down by w rows).
template <class T>
struct LinearPart {
  Tensor<T> query_features;  // [B,H,n,m'] φ(q) (empty for given features: the input is used)
  Tensor<T> key_features;    // [B,H,n,m'] row t: φ(k_{t−w}) when s <= t − w < L, else 0
  Tensor<T> values;          // [B,H,n,d_v+1] row t: [v_{t−w} | 1] for the same rows, else 0
  Tensor<T> log_gate;        // [B,H,n]: λ_h (0 without decay)
  TensorView<const T> fq;    // φ(q): query_features or the given input
  bool any = false;          // some row holds a linear key
};

// The rows of the shifted sequence that hold a linear key, [begin, end): key j at row j + w,
// from the first key after the sinks to the last of the L visible ones, within the n rows.
struct LinearRows {
  int64_t first_key, begin, end;
  int64_t count() const { return end - begin; }
};

inline LinearRows linear_rows(const Setup& s, int64_t L) {
  const int64_t n = s.d.n_q, w = s.opts.window, first = std::min(s.opts.sinks, L);
  const int64_t begin = std::min(first + w, n);
  return {first, begin, std::max(std::min(L + w, n), begin)};
}

template <class T>
LinearPart<T> linear_part(const Setup& s, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                          const HybridInputs<T>& in, const KeyMask& mask) {
  const AttentionDims& d = s.d;
  const int64_t n = d.n_q, m = s.features, dv = d.value_dim;
  LinearPart<T> lp;
  lp.key_features = Tensor<T>({d.batch, d.heads, n, m}, true, Init::Uninitialized);
  lp.values = Tensor<T>({d.batch, d.heads, n, dv + 1}, true, Init::Uninitialized);
  lp.log_gate = Tensor<T>({d.batch, d.heads, n}, true, Init::Uninitialized);
  const bool given = s.given();
  if (!given) lp.query_features = Tensor<T>({d.batch, d.heads, n, m}, true, Init::Uninitialized);
  lp.fq = given ? *in.query_features : lp.query_features.view();
  for (int64_t b = 0; b < d.batch; ++b)
    if (linear_rows(s, mask.key_length(b)).count() > 0) lp.any = true;
  const std::optional<FeatureMap<T>> map = given ? std::nullopt : std::optional(plain_map<T>("hybrid_attention", s));
  parallel_for(d.bh(), [&](int64_t bh) {
    const LinearRows rows = linear_rows(s, mask.key_length(bh / d.heads));
    const T lambda = s.log_decay.empty() ? T(0) : static_cast<T>(s.log_decay[static_cast<size_t>(bh % d.heads)]);
    std::fill(lp.log_gate.data() + bh * n, lp.log_gate.data() + (bh + 1) * n, lambda);
    if (map) map->features(q.row(bh, 0), n, lp.query_features.data() + bh * n * m);
    T* fk = lp.key_features.data() + bh * n * m;
    T* vv = lp.values.data() + bh * n * (dv + 1);
    std::fill(fk, fk + rows.begin * m, T(0));  // no linear key in these rows
    std::fill(fk + rows.end * m, fk + n * m, T(0));
    std::fill(vv, vv + rows.begin * (dv + 1), T(0));
    std::fill(vv + rows.end * (dv + 1), vv + n * (dv + 1), T(0));
    if (map) {
      map->features(k.row(bh, rows.first_key), rows.count(), fk + rows.begin * m);
    } else {
      const T* given_keys = in.key_features->row(bh, rows.first_key);
      std::copy(given_keys, given_keys + rows.count() * m, fk + rows.begin * m);
    }
    for (int64_t r = 0; r < rows.count(); ++r) {
      const T* vj = v.row(bh, rows.first_key + r);
      std::copy(vj, vj + dv, vv + (rows.begin + r) * (dv + 1));
      vv[(rows.begin + r) * (dv + 1) + dv] = 1;
    }
  });
  return lp;
}

template <class T>
GatedLinearAttentionOptions linear_options() {
  GatedLinearAttentionOptions o;
  o.scale = 1.0;
  o.causal = true;
  return o;
}

// The keys a tile of query rows [begin, end) of an item with L keys sees exactly: columns
// [0, sink_end) are the sinks, then [band_begin, band_end) (which may hold sinks too, when the
// window reaches them); every other key is linear for every row of the tile.
struct Tile {
  int64_t begin, end, sink_end, band_begin, band_end;
  int64_t rows() const { return end - begin; }
  int64_t columns() const { return sink_end + band_end - band_begin; }
  int64_t key(int64_t col) const { return col < sink_end ? col : band_begin + (col - sink_end); }
};

Tile tile(const Setup& s, int64_t begin, int64_t L) {
  const int64_t end = std::min(begin + kTileRows, s.d.n_q), w = s.opts.window;
  const int64_t band_begin = std::clamp<int64_t>(begin + 1 - w, 0, L);
  // Without a window the band holds only sinks the tile's later rows reach (none past the sinks).
  const int64_t band_end = w == 0 && s.opts.sinks <= band_begin ? band_begin : std::clamp<int64_t>(end, band_begin, L);
  return {begin, end, std::min({s.opts.sinks, L, band_begin}), band_begin, band_end};
}

// Per-worker scratch of one tile.
template <class T>
struct TileScratch {
  explicit TileScratch(const Setup& s)
      : columns((s.opts.sinks + kTileRows + s.opts.window + 15) / 16 * 16),
        e(kTileRows * columns, true, Init::Uninitialized),
        keys_t(std::is_same_v<T, float> ? s.d.head_dim * columns : 0, true, Init::Uninitialized),
        gv(kTileRows * columns, true, Init::Uninitialized),
        num(kTileRows * s.d.value_dim, true, Init::Uninitialized),
        den(kTileRows, true, Init::Uninitialized),
        top(static_cast<size_t>(kTileRows)) {}
  int64_t columns;  // the leading dimension of e and gv (a multiple of 16, for tile_matmul)
  Buffer<T> e, keys_t, gv, num, den;  // keys_t: float32, scale·(the tile's keys)ᵀ [head_dim × columns]
  std::vector<int64_t> top;  // per row: the column of its first maximum score (−1: no exact key)
};

// One item's rows.
template <class T>
struct Rows {
  const T *q, *k, *v;
  int64_t L;
  T gamma;
};

// C [rows × keys] (ld ldc) = alpha·A·x_keysᵀ: A [rows × inner] (ld lda), x the keys' rows
// [L × inner], over the tile's two key ranges (the scores, g·vᵀ).
template <class T>
void times_keys_transposed(const Tile& t, const T* a, int64_t lda, int64_t inner, const T* x, T* c, int64_t ldc,
                           T alpha) {
  const Mat<const T> A = mat(a, t.rows(), inner, lda);
  if (t.sink_end > 0) matmul<T>(mat(c, t.rows(), t.sink_end, ldc), A, mat(x, t.sink_end, inner).t(), alpha);
  if (t.band_end > t.band_begin)
    matmul<T>(mat(c + t.sink_end, t.rows(), t.band_end - t.band_begin, ldc), A,
              mat(x + t.band_begin * inner, t.band_end - t.band_begin, inner).t(), alpha);
}

// out [rows × width] = alpha·E·x_keys + beta·out: E the tile's weights (ld lde), x the keys' rows.
template <class T>
void times_keys(const Tile& t, const T* e, int64_t lde, const T* x, int64_t width, T* out, T alpha, T beta) {
  matmul<T>(mat(out, t.rows(), width), mat(e, t.rows(), t.sink_end, lde), mat(x, t.sink_end, width), alpha, beta);
  matmul<T>(mat(out, t.rows(), width), mat(e + t.sink_end, t.rows(), t.band_end - t.band_begin, lde),
            mat(x + t.band_begin * width, t.band_end - t.band_begin, width), alpha, T(1));
}

// x_keys [keys × width] += alpha·Eᵀ·Y: E the tile's weights (ld lde), Y [rows × width] (ld ldy).
template <class T>
void keys_plus_transposed(const Tile& t, const T* e, int64_t lde, const T* y, int64_t ldy, int64_t width, T* x,
                          T alpha) {
  const Mat<const T> Y = mat(y, t.rows(), width, ldy);
  if (t.sink_end > 0) matmul<T>(mat(x, t.sink_end, width), mat(e, t.rows(), t.sink_end, lde).t(), Y, alpha, T(1));
  if (t.band_end > t.band_begin)
    matmul<T>(mat(x + t.band_begin * width, t.band_end - t.band_begin, width),
              mat(e + t.sink_end, t.rows(), t.band_end - t.band_begin, lde).t(), Y, alpha, T(1));
}

// The window part of a tile: scratch.e = e_ij = exp(s_ij − M_i) on each row's exact keys and 0
// elsewhere, scratch.num = Σ_j e_ij v_j, scratch.den = Σ_j e_ij; scratch.top: −1 for a row with no
// exact key, else (want_top) the column of its first maximum score.
template <class T>
void window_forward(const Setup& s, const Rows<T>& it, const Tile& t, TileScratch<T>& w, bool want_top) {
  const int64_t hd = s.d.head_dim, dv = s.d.value_dim, cols = t.columns(), ld = w.columns, win = s.opts.window;
  T* e = w.e.data();
  // float32 runs the tile's two products on the library's own tile kernels (core/tile_matmul.h:
  // OpenBLAS packs both operands again on each of these thousands of small calls), with the keys
  // transposed once per tile; float64 on the BLAS.
  const bool tiles = std::is_same_v<T, float> && dv % 16 == 0;
  if constexpr (std::is_same_v<T, float>) {
    if (cols > 0) {
      const int64_t padded = (cols + 15) / 16 * 16;
      float* kt = w.keys_t.data();
      const float sc = static_cast<float>(s.scale);
      for (int64_t p = 0; p < hd; ++p) {
        float* row = kt + p * padded;
        for (int64_t c = 0; c < cols; ++c) row[c] = sc * it.k[t.key(c) * hd + p];
        std::fill(row + cols, row + padded, 0.0f);
      }
      tile_matmul::multiply(it.q + t.begin * hd, hd, t.rows(), kt, padded, hd, padded, e, ld, false);
    }
  } else if (cols > 0) {
    times_keys_transposed(t, it.q + t.begin * hd, hd, hd, it.k, e, ld, static_cast<T>(s.scale));
  }
  for (int64_t r = 0; r < t.rows(); ++r) {
    const int64_t i = t.begin + r;
    T* row = e + r * ld;
    // Exact columns of row i: the sinks [0, sink_end); in the band, keys j < s (sinks the window
    // reached) and the window max(i + 1 − w, band_begin) <= j <= i.
    const int64_t lo = std::clamp(i + 1 - win, t.band_begin, t.band_end);
    const int64_t hi = std::clamp(i + 1, lo, t.band_end);
    const int64_t sinks_in_band = std::clamp(s.opts.sinks, t.band_begin, lo) - t.band_begin;
    const int64_t sink_cols = t.sink_end + sinks_in_band;
    const int64_t win_begin = t.sink_end + (lo - t.band_begin), win_end = t.sink_end + (hi - t.band_begin);
    if (win_end == win_begin && sink_cols == 0) {  // no exact key
      w.top[static_cast<size_t>(r)] = -1;
      std::fill(row, row + cols, T(0));
      w.den[r] = 0;
      continue;
    }
    const T M = std::max(simd::max_value(row, static_cast<size_t>(sink_cols)),
                         simd::max_value(row + win_begin, static_cast<size_t>(win_end - win_begin)));
    int64_t top = -1;  // the first maximum (the backward's ∂M_i goes there), found only when wanted
    if (want_top) {
      top = std::find(row, row + sink_cols, M) - row;
      if (top == sink_cols) top = std::find(row + win_begin, row + win_end, M) - row;
    }
    w.top[static_cast<size_t>(r)] = top;
    std::fill(row + sink_cols, row + win_begin, T(0));
    std::fill(row + win_end, row + cols, T(0));
    w.den[r] = simd::exp_shifted_sum(row, static_cast<size_t>(sink_cols), M) +
               simd::exp_shifted_sum(row + win_begin, static_cast<size_t>(win_end - win_begin), M);
  }
  if (cols > 0 && tiles) {
    if constexpr (std::is_same_v<T, float>) {
      tile_matmul::multiply(e, ld, t.rows(), it.v, dv, t.sink_end, dv, w.num.data(), dv, false);
      tile_matmul::multiply(e + t.sink_end, ld, t.rows(), it.v + t.band_begin * dv, dv, t.band_end - t.band_begin, dv,
                            w.num.data(), dv, true);
    }
  } else if (cols > 0) {
    times_keys(t, e, ld, it.v, dv, w.num.data(), T(1), T(0));
  } else {
    std::fill(w.num.data(), w.num.data() + t.rows() * dv, T(0));
  }
}

// One item's rows with e^{λw} (the linear part's weight for the shift) and eps.
template <class T>
struct Item {
  Rows<T> rows;
  T reach, eps;
};

template <class T>
Item<T> item(const Setup& s, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
             const KeyMask& mask, int64_t bh) {
  const int64_t h = bh % s.d.heads;
  const double lambda = s.log_decay.empty() ? 0.0 : s.log_decay[static_cast<size_t>(h)];
  return {{q.row(bh, 0), k.row(bh, 0), v.row(bh, 0), mask.key_length(bh / s.d.heads),
           static_cast<T>(s.gamma[static_cast<size_t>(h)])},
          static_cast<T>(std::exp(lambda * static_cast<double>(s.opts.window))),
          static_cast<T>(s.opts.eps)};
}

// A tile's outputs (after window_forward): out row r = (γ N_r + e^{λw} num_r) / B_r, B_r =
// γ D_r + e^{λw} den_r + eps left in w.den (0 for a row with no keys and eps = 0: out 0).
// linear: the item's [num | den] rows, or null without a linear part.
template <class T>
void combine(const Item<T>& it, const Tile& t, const T* linear, int64_t dv, TileScratch<T>& w, T* out) {
  const T gamma = it.rows.gamma;
  for (int64_t r = 0; r < t.rows(); ++r) {
    const T* lin = linear ? linear + (t.begin + r) * (dv + 1) : nullptr;
    const T D = gamma * w.den[r] + (lin ? it.reach * lin[dv] : T(0)) + it.eps;
    const T* nw = w.num.data() + r * dv;
    T* o = out + r * dv;
    for (int64_t c = 0; c < dv; ++c) o[c] = D > 0 ? (gamma * nw[c] + (lin ? it.reach * lin[c] : T(0))) / D : T(0);
    w.den[r] = D;
  }
}

}  // namespace

template <class T>
void blocked_forward(const Setup& s, TensorView<const T> q, TensorView<const T> k,
                     TensorView<const T> v, const HybridInputs<T>& in, const KeyMask& mask, T* out) {
  const AttentionDims& d = s.d;
  const int64_t n = d.n_q, dv = d.value_dim;
  const LinearPart<T> lp = linear_part(s, q, k, v, in, mask);
  const Tensor<T> linear = lp.any ? gated_linear_attention<T>(lp.fq, lp.key_features, lp.values, lp.log_gate, {},
                                                               linear_options<T>()).out
                                  : Tensor<T>();
  const ParallelLoop loop(d.bh());
  PerWorker<TileScratch<T>> scratch(loop, [&] { return TileScratch<T>(s); });
  loop.run([&](int64_t bh, int worker) {
    interruption_point();
    auto& w = scratch[worker];
    const Item<T> it = item(s, q, k, v, mask, bh);
    const T* lin = lp.any ? linear.data() + bh * n * (dv + 1) : nullptr;
    for (int64_t begin = 0; begin < n; begin += kTileRows) {
      const Tile t = tile(s, begin, it.rows.L);
      window_forward(s, it.rows, t, w, false);
      combine(it, t, lin, dv, w, out + (bh * n + begin) * dv);
    }
  });
}

template <class T>
void blocked_backward(const Setup& s, TensorView<const T> q, TensorView<const T> k,
                      TensorView<const T> v, TensorView<const T> dout, const HybridInputs<T>& in,
                      const KeyMask& mask, AttentionGrads<T>& grads, T* dfq_given, T* dfk_given,
                      std::vector<double>& dgamma) {
  const AttentionDims& d = s.d;
  const int64_t n = d.n_q, dv = d.value_dim, hd = d.head_dim, m = s.features;
  const LinearPart<T> lp = linear_part(s, q, k, v, in, mask);
  const GatedLinearAttentionOptions lo = linear_options<T>();
  const Tensor<T> linear =
      lp.any ? gated_linear_attention<T>(lp.fq, lp.key_features, lp.values, lp.log_gate, {}, lo).out : Tensor<T>();
  // The gradient of the linear part's output [num | den], e^{λw}·[g_i | c_i].
  Tensor<T> dlinear = lp.any ? Tensor<T>({d.batch, d.heads, n, dv + 1}, true, Init::Uninitialized) : Tensor<T>();
  const ParallelLoop loop(d.bh());
  PerWorker<TileScratch<T>> scratch(loop, [&] { return TileScratch<T>(s); });
  PerWorker<Buffer<T>> gbuf(loop, [&] { return Buffer<T>(kTileRows * (dv + 1), true, Init::Uninitialized); });
  PerWorker<Buffer<T>> obuf(loop, [&] { return Buffer<T>(kTileRows * dv, true, Init::Uninitialized); });
  const T sc = static_cast<T>(s.scale);
  loop.run([&](int64_t bh, int worker) {
    interruption_point();
    auto& w = scratch[worker];
    const Item<T> item_rows = item(s, q, k, v, mask, bh);
    const Rows<T>& it = item_rows.rows;
    const T* lin = lp.any ? linear.data() + bh * n * (dv + 1) : nullptr;
    T *dq = grads.dq.data() + bh * n * hd, *dk = grads.dk.data() + bh * n * hd, *dvv = grads.dv.data() + bh * n * dv;
    T* g = gbuf[worker].data();  // per row [g_i | c_i]
    T* o = obuf[worker].data();
    double dgam = 0;
    for (int64_t begin = 0; begin < n; begin += kTileRows) {
      const Tile t = tile(s, begin, it.L);
      window_forward(s, it, t, w, true);
      combine(item_rows, t, lin, dv, w, o);
      for (int64_t r = 0; r < t.rows(); ++r) {
        const T D = w.den[r];
        const T* go = dout.row(bh, t.begin + r);
        T* gr = g + r * (dv + 1);
        T dot = 0;
        for (int64_t c = 0; c < dv; ++c) {
          gr[c] = D > 0 ? go[c] / D : T(0);
          dot += go[c] * o[r * dv + c];
        }
        gr[dv] = D > 0 ? -dot / D : T(0);
        if (lp.any) {
          T* dl = dlinear.data() + (bh * n + t.begin + r) * (dv + 1);
          for (int64_t c = 0; c <= dv; ++c) dl[c] = item_rows.reach * gr[c];
        }
      }
      const int64_t cols = t.columns(), ld = w.columns;
      if (cols == 0) continue;
      // dv_j += γ Σ_i e_ij g_i; gv_ij = g_i·v_j; then ds_ij = γ e_ij (gv_ij + c_i) in place of e
      // (dγ += Σ e_ij (gv_ij + c_i)), the shift's share at the maximum, and dq, dk from ds.
      keys_plus_transposed(t, w.e.data(), ld, g, dv + 1, dv, dvv, it.gamma);
      times_keys_transposed(t, g, dv + 1, dv, it.v, w.gv.data(), ld, T(1));
      for (int64_t r = 0; r < t.rows(); ++r) {
        const int64_t top = w.top[static_cast<size_t>(r)];
        if (top < 0) continue;
        T* e = w.e.data() + r * ld;
        const T* gv = w.gv.data() + r * ld;
        const T c = g[r * (dv + 1) + dv];
        T shift = 0;
        double row_dgam = 0;
        for (int64_t col = 0; col < cols; ++col) {
          const T a = e[col] * (gv[col] + c);  // 0 off the row's exact keys (e = 0)
          row_dgam += static_cast<double>(a);
          e[col] = it.gamma * a;
          shift -= e[col];
        }
        dgam += row_dgam;
        e[top] += shift;  // ∂M_i: the maximum's score carries −Σ_j ds_ij
      }
      times_keys<T>(t, w.e.data(), ld, it.k, hd, dq + t.begin * hd, sc, T(1));
      keys_plus_transposed(t, w.e.data(), ld, it.q + t.begin * hd, hd, hd, dk, sc);
    }
    dgamma[static_cast<size_t>(bh)] = dgam;
  });
  if (!lp.any) return;
  const GatedLinearAttentionGrads<T> lg = gated_linear_attention_backward<T>(
      lp.fq, lp.key_features, lp.values, lp.log_gate, {}, dlinear, {}, lo);
  // Back up by w rows and through the map: dq, dk add it (the window's share is in them).
  const bool given = s.given();
  const std::optional<FeatureMap<T>> map = given ? std::nullopt : std::optional(plain_map<T>("hybrid_attention", s));
  parallel_for(d.bh(), [&](int64_t bh) {
    const LinearRows rows = linear_rows(s, mask.key_length(bh / d.heads));
    const int64_t first = rows.first_key, rows_begin = rows.begin, linear_keys = rows.count();
    const T* dfq = lg.dq.data() + bh * n * m;
    const T* dfk = lg.dk.data() + (bh * n + rows_begin) * m;
    T* dvv = grads.dv.data() + bh * n * dv;
    for (int64_t j = 0; j < linear_keys; ++j)
      for (int64_t c = 0; c < dv; ++c) dvv[(first + j) * dv + c] += lg.dv.data()[(bh * n + rows_begin + j) * (dv + 1) + c];
    if (given) {
      std::copy(dfq, dfq + n * m, dfq_given + bh * n * m);
      std::copy(dfk, dfk + linear_keys * m, dfk_given + (bh * n + first) * m);
      return;
    }
    std::vector<T> dx(static_cast<size_t>(n * hd));
    auto add = [&](T* to, int64_t rows) {
      for (int64_t i = 0; i < rows * hd; ++i) to[i] += dx[static_cast<size_t>(i)];
    };
    map->features_backward(q.row(bh, 0), n, lp.fq.data + bh * n * m, dfq, dx.data());
    add(grads.dq.data() + bh * n * hd, n);
    map->features_backward(k.row(bh, first), linear_keys, lp.key_features.data() + (bh * n + rows_begin) * m, dfk,
                           dx.data());
    add(grads.dk.data() + (bh * n + first) * hd, linear_keys);
  });
}

#define LINATTN_INSTANTIATE(T)                                                                                   \
  template void blocked_forward<T>(const Setup&, TensorView<const T>, TensorView<const T>,          \
                                   TensorView<const T>, const HybridInputs<T>&, const KeyMask&, T*);            \
  template void blocked_backward<T>(const Setup&, TensorView<const T>, TensorView<const T>,         \
                                    TensorView<const T>, TensorView<const T>, const HybridInputs<T>&,            \
                                    const KeyMask&, AttentionGrads<T>&, T*, T*, std::vector<double>&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn::hybrid
