// Sliding-window + linear hybrid, forward and backward, per (batch, head) item:
//   linear part: the state [S | z] = Σ φ(k_j) ⊗ [v_j | 1] of the keys left of the window, swept
//     forwards over the queries (every boundary is non-decreasing in i: internal.h), and, not
//     causal, of the keys right of it, swept backwards; num_i = φ(q_i)ᵀS, den_i = φ(q_i)·z;
//   window part: e_ij = exp(s_ij − M_i) over at most 2w+1 keys, added with weight γ_h;
//   out_i = num_i / (den_i + eps).
// Backward (out, den recomputed: nothing is saved): g_i = dout_i/D_i, c_i = −dout_i·out_i/D_i
// (D_i = den_i + eps) are the gradients of num_i and den_i; the linear part gives
// dφ(q_i) = S g_i + c_i z from the same sweeps, and dφ(k_j) = R v_j + ρ, dv_j += Rᵀφ(k_j) from
// the reverse sweeps of [R | ρ] = Σ φ(q_i) ⊗ [g_i | c_i] over the queries whose linear part holds
// key j; the window gives de_ij = γ(g_i·v_j + c_i), dv_j += γ e_ij g_i, ds_ij = e_ij de_ij, and
// the shift M_i = s_i,argmax takes −Σ_j ds_ij (the linear part is not shifted, so the output is
// not invariant to M_i and its gradient counts). Parallel over items: no atomics.
// FAVOR's features (φ_r = exp(L_r)/√m', estimating e^{s_ij}): the window is unshifted, so every
// term of row i is put on one scale R_i = max(M_i, max_r(L_q,ir + peak_r)) over the states it
// meets, raised as the terms arrive (num_i, den_i rescaled); each state keeps per-feature
// running maxima (peak) of what entered it, so every stored term is <= 1 and eps enters as
// eps·e^{−R_i}. R_i and the peaks only shift whole rows and columns: they take no gradient, and
// the backward uses the same sums, weighted by the features themselves (∂exp(L)/∂L = exp(L)).
#include <algorithm>
#include <cmath>
#include <limits>

#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/core/simd.h"
#include "linattn/hybrid/internal.h"
#include "linattn/memory.h"

namespace linattn {
namespace hybrid {
namespace {

// Largest value of a feature tensor's first rows[b] rows of every item; Error naming fn and
// the tensor at a negative or non-finite value.
template <class T>
double check_features(const char* fn, const char* name, TensorView<const T> f, const AttentionDims& d,
                      const KeyMask* mask) {
  const int64_t m = f.dim(3);
  auto count = [&](int64_t bh) { return static_cast<size_t>((mask ? mask->key_length(bh / d.heads) : f.dim(2)) * m); };
  // One vector pass per item on every worker (NaN when a value is not finite) and a branch-free
  // sign test; the scalar scan below only runs to name a bad value.
  std::vector<double> largest(static_cast<size_t>(d.bh()));
  parallel_for(d.bh(), [&](int64_t bh) {
    const T* x = f.row(bh, 0);
    const size_t c = count(bh);
    bool negative = false;
    for (size_t i = 0; i < c; ++i) negative |= x[i] < 0;
    largest[static_cast<size_t>(bh)] =
        negative ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(simd::finite_max_abs(x, c));
  });
  double top = 0;
  for (int64_t bh = 0; bh < d.bh(); ++bh) {
    if (std::isfinite(largest[static_cast<size_t>(bh)])) {
      top = std::max(top, largest[static_cast<size_t>(bh)]);
      continue;
    }
    const T* x = f.row(bh, 0);
    for (size_t i = 0; i < count(bh); ++i)
      require(std::isfinite(x[i]) && x[i] >= 0, fn, ": ", name, " must be finite and >= 0 (features of a map of ",
              "the caller's); found ", x[i], " at flat index ", bh * f.dim(2) * m + static_cast<int64_t>(i));
  }
  return top;
}

}  // namespace

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 const HybridInputs<T>& in, const HybridAttentionOptions& opts) {
  Setup s;
  s.opts = opts;
  s.d = check_attention_args(fn, q, k, v, opts);
  s.scale = resolve_scale(fn, opts, s.d.head_dim);
  const AttentionDims& d = s.d;
  require(opts.window >= 0, fn, ": window must be >= 0 (0: no window, plain linear attention), got ", opts.window);
  require(opts.sinks >= 0, fn, ": sinks must be >= 0 (0: none), got ", opts.sinks);
  require(opts.sinks == 0 || opts.causal, fn, ": sinks = ", opts.sinks,
          " needs causal=true: attention sinks are the first keys of a causal sequence");
  require(std::isfinite(opts.eps) && opts.eps >= 0, fn, ": eps must be finite and >= 0, got ", opts.eps);
  const bool favor = opts.feature_map == "favor";
  if (!favor) {
    require(std::find(plain_feature_map_names().begin(), plain_feature_map_names().end(), opts.feature_map) !=
                plain_feature_map_names().end(),
            fn, ": feature_map must be ", plain_feature_map_choices("favor"), ", got \"", opts.feature_map, "\"");
    s.map = parse_plain_feature_map(fn, opts.feature_map);
  }
  const HybridAttentionOptions defaults;
  if (s.map == FeatureMapKind::Focused) {
    plain_map<T>(fn, s);  // checks focus_power
  } else {
    require(opts.focus_power == defaults.focus_power, fn, ": focus_power=", opts.focus_power,
            " applies to feature_map='focused' only, but feature_map is '", opts.feature_map, "'");
  }
  if (favor) {
    require(opts.kernel == "positive" || opts.kernel == "hyperbolic", fn,
            ": kernel must be 'positive' or 'hyperbolic' with feature_map='favor' (the hybrid's weights must be >= 0; "
            "trig's are not), got '", opts.kernel, "'");
    s.map = parse_favor_kernel(fn, opts.kernel);
    require(in.projection.has_value(), fn,
            ": feature_map='favor' needs projection ω [num_features, head_dim] (from random_features)");
    s.features = favor_map(fn, s, in).dim();  // checks the projection's shape and values and scale > 0
  } else {
    require(!in.projection, fn, ": projection is given, but feature_map is '", opts.feature_map,
            "'; pass feature_map='favor' to use it");
    require(opts.kernel == defaults.kernel, fn, ": kernel='", opts.kernel, "' applies to feature_map='favor' only, but ",
            "feature_map is '", opts.feature_map, "'");
  }
  if (s.given()) {
    require(in.query_features && in.key_features, fn,
            ": feature_map='given' needs query_features [batch, heads, n_q, m'] and key_features [batch, heads, "
            "n_k, m']");
    const TensorView<const T> fq = *in.query_features, fk = *in.key_features;
    require(fq.rank() == 4 && fq.dim(0) == d.batch && fq.dim(1) == d.heads && fq.dim(2) == d.n_q && fq.dim(3) >= 1,
            fn, ": query_features has shape ", shape_string(fq.shape), "; expected [", d.batch, ", ", d.heads, ", ",
            d.n_q, ", m'] with m' >= 1 (batch, heads and rows of q)");
    s.features = fq.dim(3);
    require(fk.rank() == 4 && fk.dim(0) == d.batch && fk.dim(1) == d.heads && fk.dim(2) == d.n_k &&
                fk.dim(3) == s.features,
            fn, ": key_features has shape ", shape_string(fk.shape), "; expected [", d.batch, ", ", d.heads, ", ",
            d.n_k, ", ", s.features, "] (batch, heads and rows of k, m' of query_features)");
    const KeyMask mask(d, opts);
    s.feature_max_q = check_features(fn, "query_features", fq, d, nullptr);
    s.feature_max_k = check_features(fn, "key_features", fk, d, &mask);
  } else {
    require(!in.query_features && !in.key_features, fn, ": query_features or key_features is given, but feature_map ",
            "is '", opts.feature_map, "'; pass feature_map='given' to use them");
  }
  if (s.favor()) {
    // Every term is shifted to at most 1 (R_i, the states' running maxima): nothing to bound.
    s.feature_max_q = s.feature_max_k = 1;
  } else if (!s.given()) {
    s.features = d.head_dim;
    s.feature_max_q = plain_feature_bound(s.map, d.q_max, d.head_dim);
    s.feature_max_k = plain_feature_bound(s.map, d.k_max, d.head_dim);
  }
  s.gamma.assign(static_cast<size_t>(d.heads), 1.0);
  if (in.window_gate) {
    const TensorView<const T> g = *in.window_gate;
    require(g.rank() == 1 && g.dim(0) == d.heads, fn, ": window_gate has shape ", shape_string(g.shape),
            "; expected [", d.heads, "] (one gate per head)");
    check_finite(fn, "window_gate", g);
    for (int64_t h = 0; h < d.heads; ++h) s.gamma[static_cast<size_t>(h)] = sigmoid(static_cast<double>(g.data[h]));
  }
  if (in.log_decay) {
    const TensorView<const T> l = *in.log_decay;
    require(opts.causal, fn, ": log_decay needs causal=true (the decay runs along the sequence)");
    require(l.rank() == 1 && l.dim(0) == d.heads, fn, ": log_decay has shape ", shape_string(l.shape),
            "; expected [", d.heads, "] (one decay per head)");
    for (int64_t h = 0; h < d.heads; ++h) {
      const double x = static_cast<double>(l.data[h]);
      require(std::isfinite(x) && x <= 0, fn, ": log_decay must be finite and <= 0, got ", x, " at head ", h);
      s.log_decay.push_back(x);
    }
  }
  // Every score and every linear weight, and their sums over n_k keys, stay inside the dtype
  // (with room for the sums): |s_ij| <= |scale|·d·max|q|·max|k|, φ(q)·φ(k) <= m'·max φ(q)·max φ(k).
  const double room = static_cast<double>(std::numeric_limits<T>::max()) / 16;
  require(std::abs(s.scale) * static_cast<double>(d.head_dim) * d.q_max * d.k_max < room, fn,
          ": q and k are too large for ", dtype_name<T>(), ": their scaled dot products can overflow (|scale|·head_dim·",
          "max|q|·max|k| = ", std::abs(s.scale) * static_cast<double>(d.head_dim) * d.q_max * d.k_max, ")");
  require(s.feature_max_q * s.feature_max_k * static_cast<double>(s.features) * static_cast<double>(std::max<int64_t>(d.n_k, 1)) <
              room,
          fn, ": the features of q and k are too large for ", dtype_name<T>(), ": the linear sums can overflow");
  return s;
}

namespace {

// Per-worker scratch, sized before the loop.
template <class T>
struct Scratch {
  Scratch(const Setup& s, bool backward) {
    const int64_t m = s.features, dv = s.d.value_dim, nq = s.d.n_q, nk = s.d.n_k;
    const bool own = s.own_features(), favor = s.favor();
    fq = Buffer<T>(own || favor ? nq * m : 0, true, Init::Uninitialized);  // favor: the logits L
    fk = Buffer<T>(own || favor ? nk * m : 0, true, Init::Uninitialized);
    state = Buffer<T>(m * dv);
    z = Buffer<T>(m);
    scores = Buffer<T>(std::min<int64_t>(2 * s.opts.window + 1 + s.opts.sinks, std::max<int64_t>(nk, 1)), true, Init::Uninitialized);
    den = Buffer<T>(nq, true, Init::Uninitialized);
    shift = Buffer<T>(nq, true, Init::Uninitialized);
    row = Buffer<T>(favor ? m : 0, true, Init::Uninitialized);
    peak = Buffer<T>(favor ? m : 0, true, Init::Uninitialized);
    if (backward) {
      num = Buffer<T>(nq * dv, true, Init::Uninitialized);
      g = Buffer<T>(nq * dv, true, Init::Uninitialized);
      c = Buffer<T>(nq, true, Init::Uninitialized);
      dfq = Buffer<T>(nq * m, true, Init::Uninitialized);
      dfk = Buffer<T>(nk * m, true, Init::Uninitialized);
      if (favor) {  // FeatureMap::logits_backward's scratch
        const int64_t hd = s.d.head_dim;
        map_scratch = Buffer<T>(std::max(nq, nk) * std::max(m, hd), true, Init::Uninitialized);
      }
    }
  }
  // shift: per query, M_i (the window's maximum score) or, with FAVOR, R_i. row and peak: FAVOR's
  // features of one row in the state's scale, and the state's per-feature shifts.
  Buffer<T> fq, fk, state, z, scores, den, shift, row, peak, num, g, c, dfq, dfk, map_scratch;
};

// One item's rows: inputs, features (given, made in scratch, or FAVOR's logits) and γ.
template <class T>
struct Item {
  const T *q, *k, *v, *fq, *fk;
  T gamma;
  int64_t L;
  double log_decay = 0;  // λ of the item's head (0: no decay)
  bool decayed() const { return log_decay < 0; }
  // e^{λ·distance}: the weight of a linear term `distance` positions back
  T decay(int64_t distance) const { return static_cast<T>(std::exp(log_decay * static_cast<double>(distance))); }
};

template <class T>
Item<T> item(const char* fn, const Setup& s, const FeatureMap<T>* favor, TensorView<const T> q, TensorView<const T> k,
             TensorView<const T> v, const HybridInputs<T>& in, const KeyMask& mask, int64_t bh, Scratch<T>& w) {
  Item<T> it{q.row(bh, 0), k.row(bh, 0), v.row(bh, 0), nullptr, nullptr,
             static_cast<T>(s.gamma[static_cast<size_t>(bh % s.d.heads)]), mask.key_length(bh / s.d.heads)};
  if (!s.log_decay.empty()) it.log_decay = s.log_decay[static_cast<size_t>(bh % s.d.heads)];
  if (s.given()) {
    it.fq = in.query_features->row(bh, 0);
    it.fk = in.key_features->row(bh, 0);
    return it;
  }
  if (s.favor()) {  // L = ω·x̃ − ‖x̃‖²/2 for queries too: their norm no longer cancels
    favor->logits(fn, it.q, s.d.n_q, Side::QueryWithNorm, w.fq.data(), nullptr);
    favor->logits(fn, it.k, it.L, Side::Key, w.fk.data(), nullptr);
  } else {
    const FeatureMap<T> map = plain_map<T>(fn, s);
    map.features(it.q, s.d.n_q, w.fq.data());
    map.features(it.k, it.L, w.fk.data());
  }
  it.fq = w.fq.data();
  it.fk = w.fk.data();
  return it;
}

// [S | z] += weight·a ⊗ [b | b_last] (m × dv, and a column): keys add [v_j | 1], queries [g_i | c_i].
template <class T>
void add_outer(T* S, T* z, const T* a, const T* b, T b_last, int64_t m, int64_t dv, T weight = T(1)) {
  for (int64_t c = 0; c < m; ++c) {
    const T ac = weight * a[c];
    T* row = S + c * dv;
    for (int64_t t = 0; t < dv; ++t) row[t] += ac * b[t];
    z[c] += ac * b_last;
  }
}

// [num | den] += fᵀ[S | z].
template <class T>
void apply_state(const T* S, const T* z, const T* f, int64_t m, int64_t dv, T* num, T* den) {
  for (int64_t c = 0; c < m; ++c) {
    const T fc = f[c];
    const T* row = S + c * dv;
    for (int64_t t = 0; t < dv; ++t) num[t] += fc * row[t];
    *den += fc * z[c];
  }
}

// [S | z] *= factor: the state one position further on (a decay step).
template <class T>
void scale_state(Scratch<T>& w, const Setup& s, T factor) {
  simd::scale(w.state.data(), static_cast<size_t>(s.features * s.d.value_dim), factor);
  simd::scale(w.z.data(), static_cast<size_t>(s.features), factor);
}

template <class T>
void clear_state(Scratch<T>& w, const Setup& s) {
  std::fill(w.state.data(), w.state.data() + s.features * s.d.value_dim, T(0));
  std::fill(w.z.data(), w.z.data() + s.features, T(0));
  if (s.favor()) std::fill(w.peak.data(), w.peak.data() + s.features, -std::numeric_limits<T>::infinity());
}

// FAVOR, a row x of logits entering a state whose rows r are in the scale exp(−peak_r): raises
// peak to max(peak, x) (rescaling the rows whose shift rises, so every entry stays <= its count
// of terms) and leaves exp(x − peak) in w.row, each <= 1 (x may be w.row itself).
template <class T>
const T* enter_state(const Setup& s, const T* x, Scratch<T>& w) {
  const int64_t m = s.features, dv = s.d.value_dim;
  T* peak = w.peak.data();
  for (int64_t r = 0; r < m; ++r) {
    if (!(x[r] > peak[r])) continue;
    if (peak[r] > -std::numeric_limits<T>::infinity()) {
      const T factor = std::exp(peak[r] - x[r]);
      T* row = w.state.data() + r * dv;
      for (int64_t t = 0; t < dv; ++t) row[t] *= factor;
      w.z[r] *= factor;
    }
    peak[r] = x[r];
  }
  if (x != w.row.data()) std::copy(x, x + m, w.row.data());
  simd::exp_minus_columns(w.row.data(), 1, static_cast<size_t>(m), static_cast<size_t>(m), peak);
  return w.row.data();
}

// The key features entering the forward state [S | z]: φ(k_j) itself, or FAVOR's in the state's
// scale.
template <class T>
const T* key_entering(const Setup& s, const Item<T>& it, int64_t j, Scratch<T>& w) {
  const T* f = it.fk + j * s.features;
  return s.favor() ? enter_state(s, f, w) : f;
}

// FAVOR, query i meeting a state of keys in scale exp(−peak): its features in the scale of row
// i's shift R_i, exp(L_q,ir + peak_r − R_i)/m', in w.row. forward: R_i is raised first to cover
// them (rescaling num_i and den_i), so every weight stays <= 1.
template <class T>
const T* query_meeting_state(const Setup& s, const Item<T>& it, int64_t i, Scratch<T>& w, T* num, T* den, bool forward) {
  const int64_t m = s.features, dv = s.d.value_dim;
  T* f = w.row.data();
  std::copy(it.fq + i * m, it.fq + (i + 1) * m, f);
  const T top = simd::exp_row_offset(f, static_cast<size_t>(m), w.peak.data());  // f = exp(L + peak − top)
  T& R = w.shift[i];
  if (forward && top > R) {
    if (R > -std::numeric_limits<T>::infinity()) {
      const T factor = std::exp(R - top);
      for (int64_t t = 0; t < dv; ++t) num[i * dv + t] *= factor;
      den[i] *= factor;
    }
    R = top;
  }
  simd::scale(f, static_cast<size_t>(m), std::exp(top - R) / static_cast<T>(m));
  return f;
}

template <class T>
const T* query_features(const Setup& s, const Item<T>& it, int64_t i, Scratch<T>& w, T* num, T* den, bool forward) {
  return s.favor() ? query_meeting_state(s, it, i, w, num, den, forward) : it.fq + i * s.features;
}

// Scores of row i over its exact keys (r.exact_key(j), j < r.exact_count(): the sinks, then the
// window) into w.scores, replaced by e_ij = exp(s_ij − M_i); returns Σ e, the offset of the
// maximum (the first one) and M_i.
template <class T>
struct WindowWeights {
  T sum;
  int64_t top;
  T max_score;
};

template <class T>
WindowWeights<T> window_weights(const Setup& s, const Item<T>& it, int64_t i, const RowKeys& r, Scratch<T>& w) {
  const int64_t d = s.d.head_dim, count = r.exact_count();
  T* e = w.scores.data();
  const T sc = static_cast<T>(s.scale);
  for (int64_t j = 0; j < count; ++j)
    e[j] = sc * simd::dot(it.q + i * d, it.k + r.exact_key(j) * d, static_cast<size_t>(d));
  const int64_t top = std::max_element(e, e + count) - e;
  const T M = e[top];
  return {simd::exp_shifted_sum(e, static_cast<size_t>(count), M), top, M};
}

// The first key a linear prefix can hold: the keys before it are sinks (exact for every row).
template <class T>
int64_t first_linear_key(const Setup& s, const Item<T>& it) {
  return std::min(s.opts.sinks, it.L);
}

// The linear prefix's sweep: the state [S | z] (cleared first) holds, at row i, the keys
// [first, window_begin_i) after the sinks, each weighed by e^{λ(p_i − j)} when decayed (the state
// times e^{λ} a row, each key weighed as it enters); on_row(i) is called for every row whose
// state holds any key. The forward reads it (apply_state), the backward pulls dφ(q_i) from it.
template <class T, class OnRow>
void sweep_prefix(const Setup& s, const Item<T>& it, Scratch<T>& w, OnRow on_row) {
  const int64_t m = s.features, dv = s.d.value_dim, offset = s.d.n_k - s.d.n_q;  // p_i = i + offset
  const int64_t first = first_linear_key(s, it);
  clear_state(w, s);
  for (int64_t i = 0, pos = first; i < s.d.n_q; ++i) {
    const RowKeys r = row_keys(s, i, it.L);
    if (it.decayed() && i > 0 && pos > first) scale_state(w, s, it.decay(1));
    for (; pos < r.window_begin; ++pos)
      add_outer(w.state.data(), w.z.data(), key_entering(s, it, pos, w), it.v + pos * dv, T(1), m, dv,
                it.decay(i + offset - pos));
    if (pos > first) on_row(i);
  }
}

// num [n_q, dv], den [n_q] (without eps) and w.shift [n_q] of one item: the window (weights
// e^{s − M_i}, shift M_i, −inf without one), then the linear prefix and, not causal, suffix.
// FAVOR: the linear terms raise each row's shift to R_i as they arrive (query_meeting_state);
// the other maps leave it at M_i, which is part of their model (hybrid.h).
template <class T>
void forward_item(const Setup& s, const Item<T>& it, T* num, T* den, Scratch<T>& w) {
  const int64_t nq = s.d.n_q, dv = s.d.value_dim;
  std::fill(num, num + nq * dv, T(0));
  std::fill(den, den + nq, T(0));
  std::fill(w.shift.data(), w.shift.data() + nq, -std::numeric_limits<T>::infinity());
  for (int64_t i = 0; i < nq; ++i) {  // window
    const RowKeys r = row_keys(s, i, it.L);
    if (r.exact_count() == 0) continue;
    const WindowWeights<T> ww = window_weights(s, it, i, r, w);
    const T* e = w.scores.data();
    T* o = num + i * dv;
    for (int64_t j = 0; j < r.exact_count(); ++j) {
      const T a = it.gamma * e[j];
      const T* vj = it.v + r.exact_key(j) * dv;
      for (int64_t t = 0; t < dv; ++t) o[t] += a * vj[t];
    }
    den[i] = it.gamma * ww.sum;
    w.shift[i] = ww.max_score;
  }
  const int64_t m = s.features;
  sweep_prefix(s, it, w, [&](int64_t i) {
    apply_state(w.state.data(), w.z.data(), query_features(s, it, i, w, num, den, true), m, dv, num + i * dv, den + i);
  });
  if (!s.opts.causal && s.opts.window > 0) {  // linear suffix
    clear_state(w, s);
    for (int64_t i = nq - 1, pos = it.L; i >= 0; --i) {
      const RowKeys r = row_keys(s, i, it.L);
      while (pos > r.suffix_begin) {
        --pos;
        add_outer(w.state.data(), w.z.data(), key_entering(s, it, pos, w), it.v + pos * dv, T(1), m, dv);
      }
      if (pos < it.L) apply_state(w.state.data(), w.z.data(), query_features(s, it, i, w, num, den, true), m, dv,
                                  num + i * dv, den + i);
    }
  }
}

// eps in row i's scale: FAVOR's rows are shifted by R_i, so eps·e^{−R_i} = e^{log eps − R_i}
// (inf when that overflows: the row's weights are then all below eps's rounding, and out_i = 0
// as the model says to within it; eps = 0 stays 0 at any R_i, never 0·inf); 0 for a row with no
// keys (den = 0: out 0). The other maps: eps itself.
template <class T>
T row_eps(const Setup& s, const Scratch<T>& w, int64_t i) {
  if (!s.favor()) return static_cast<T>(s.opts.eps);
  const T R = w.shift[i];
  if (!(R > -std::numeric_limits<T>::infinity()) || s.opts.eps == 0) return T(0);
  return static_cast<T>(std::exp(std::log(s.opts.eps) - static_cast<double>(R)));
}

// FAVOR, backward: query i's features entering the reverse state [R | ρ] of queries, whose rows
// are in the scale exp(−peak): x_r = L_q,ir − R_i, at most −L_k,jr for every key j that the
// query's linear part holds (R_i covers that term), so exp(L_k,jr + peak_r) <= 1 below.
template <class T>
const T* query_entering(const Setup& s, const Item<T>& it, int64_t i, Scratch<T>& w) {
  if (!s.favor()) return it.fq + i * s.features;
  const int64_t m = s.features;
  T* x = w.row.data();
  for (int64_t r = 0; r < m; ++r) x[r] = it.fq[i * m + r] - w.shift[i];
  return enter_state(s, x, w);
}

// FAVOR, backward: key j's features meeting the reverse state, exp(L_k,jr + peak_r)/m', in w.row.
template <class T>
const T* key_meeting_state(const Setup& s, const Item<T>& it, int64_t j, Scratch<T>& w) {
  if (!s.favor()) return it.fk + j * s.features;
  const int64_t m = s.features;
  T* f = w.row.data();
  const T inv = T(1) / static_cast<T>(m);
  for (int64_t r = 0; r < m; ++r) f[r] = std::exp(it.fk[j * m + r] + w.peak[r]) * inv;
  return f;
}

}  // namespace
}  // namespace hybrid

template <class T>
Tensor<T> hybrid_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v_arg,
                           const HybridInputs<T>& in, const HybridAttentionOptions& opts) {
  const char* fn = "hybrid_attention";
  const hybrid::Setup s = hybrid::check_args(fn, q, k, v_arg, in, opts);
  const AttentionDims& d = s.d;
  const ValueScale<T> vs(v_arg, d.v_max);  // out is linear in v (range.h)
  const TensorView<const T> v = vs.view();
  const KeyMask mask(d, opts);
  const std::optional<FeatureMap<T>> favor =
      s.favor() ? std::optional(hybrid::favor_map(fn, s, in)) : std::nullopt;
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim}, false, Init::Uninitialized);
  if (hybrid::blocked_applies(s)) {
    hybrid::blocked_forward(s, q, k, v, in, mask, out.data());
    vs.restore(out);
    check_result_finite(fn, "the output", out);
    return out;
  }
  const ParallelLoop loop(d.bh());
  PerWorker<hybrid::Scratch<T>> scratch(loop, [&] { return hybrid::Scratch<T>(s, false); });
  loop.run([&](int64_t bh, int worker) {
    interruption_point();
    auto& w = scratch[worker];
    const hybrid::Item<T> it = hybrid::item(fn, s, favor ? &*favor : nullptr, q, k, v, in, mask, bh, w);
    T* num = out.data() + bh * d.n_q * d.value_dim;
    hybrid::forward_item(s, it, num, w.den.data(), w);
    for (int64_t i = 0; i < d.n_q; ++i) {
      const T D = w.den[i] + hybrid::row_eps(s, w, i);
      T* o = num + i * d.value_dim;
      for (int64_t t = 0; t < d.value_dim; ++t) o[t] = D > 0 ? o[t] / D : T(0);  // no keys, eps = 0: 0
    }
  });
  vs.restore(out);
  check_result_finite(fn, "the output", out);
  return out;
}

template <class T>
AttentionGrads<T> hybrid_attention_backward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v_arg,
                                            TensorView<const T> dout_arg, const HybridInputs<T>& in,
                                            const HybridAttentionOptions& opts) {
  const char* fn = "hybrid_attention_backward";
  const hybrid::Setup s = hybrid::check_args(fn, q, k, v_arg, in, opts);
  const AttentionDims& d = s.d;
  const double dout_max = check_same_shape_finite(fn, "dout", dout_arg, {d.batch, d.heads, d.n_q, d.value_dim});
  const ValueScale<T> vs(v_arg, d.v_max), gs(dout_arg, dout_max);
  const TensorView<const T> v = vs.view(), dout = gs.view();
  const KeyMask mask(d, opts);
  const std::optional<FeatureMap<T>> favor =
      s.favor() ? std::optional(hybrid::favor_map(fn, s, in)) : std::nullopt;
  const int64_t m = s.features, dv = s.d.value_dim, hd = d.head_dim, nq = d.n_q;
  AttentionGrads<T> grads{Tensor<T>(q.shape), Tensor<T>(k.shape), Tensor<T>(v_arg.shape), {}};
  const bool given = s.given();
  Tensor<T> dfq_all = given ? Tensor<T>(in.query_features->shape) : Tensor<T>();
  Tensor<T> dfk_all = given ? Tensor<T>(in.key_features->shape) : Tensor<T>();
  std::vector<double> dgamma(static_cast<size_t>(d.bh()), 0.0);
  const bool blocked = hybrid::blocked_applies(s);
  if (blocked)
    hybrid::blocked_backward(s, q, k, v, dout, in, mask, grads, given ? dfq_all.data() : nullptr,
                             given ? dfk_all.data() : nullptr, dgamma);
  const ParallelLoop loop(blocked ? 0 : d.bh());
  PerWorker<hybrid::Scratch<T>> scratch(loop, [&] { return hybrid::Scratch<T>(s, true); });
  const T sc = static_cast<T>(s.scale);
  loop.run([&](int64_t bh, int worker) {
    interruption_point();
    auto& w = scratch[worker];
    const hybrid::Item<T> it = hybrid::item(fn, s, favor ? &*favor : nullptr, q, k, v, in, mask, bh, w);
    T *num = w.num.data(), *den = w.den.data(), *g = w.g.data(), *c = w.c.data();
    T *dfq = given ? dfq_all.data() + bh * nq * m : w.dfq.data();
    T *dfk = given ? dfk_all.data() + bh * d.n_k * m : w.dfk.data();
    T *dq = grads.dq.data() + bh * nq * hd, *dk = grads.dk.data() + bh * d.n_k * hd;
    T* dvv = grads.dv.data() + bh * d.n_k * dv;
    hybrid::forward_item(s, it, num, den, w);
    for (int64_t i = 0; i < nq; ++i) {  // num → out; g_i = ∂/∂num_i, c_i = ∂/∂den_i
      const T D = den[i] + hybrid::row_eps(s, w, i);
      const T* go = dout.row(bh, i);
      T* o = num + i * dv;
      T dot = 0;
      for (int64_t t = 0; t < dv; ++t) {
        o[t] = D > 0 ? o[t] / D : T(0);
        g[i * dv + t] = D > 0 ? go[t] / D : T(0);
        dot += go[t] * o[t];
      }
      c[i] = D > 0 ? -dot / D : T(0);
    }
    // The linear part, as ∂/∂φ (FAVOR: ∂/∂L, the same sums with each term times its weight,
    // exp(L) being its own derivative). dφ(q_i) = S g_i + c_i z over the prefix, then the suffix.
    std::fill(dfq, dfq + nq * m, T(0));
    std::fill(dfk, dfk + it.L * m, T(0));
    auto pull = [&](int64_t i) {
      const T* fq = hybrid::query_features(s, it, i, w, num, den, false);  // FAVOR: R_i is final
      for (int64_t f = 0; f < m; ++f) {
        const T* row = w.state.data() + f * dv;
        T acc = c[i] * w.z[f];
        for (int64_t t = 0; t < dv; ++t) acc += row[t] * g[i * dv + t];
        dfq[i * m + f] += favor ? fq[f] * acc : acc;
      }
    };
    hybrid::sweep_prefix(s, it, w, pull);
    const int64_t first = hybrid::first_linear_key(s, it), offset = d.n_k - d.n_q;  // p_i = i + offset
    // [R | ρ] = Σ φ(q_i) ⊗ [g_i | c_i] over the queries that hold key j: dφ(k_j) = R v_j + ρ,
    // dv_j += Rᵀ φ(k_j).
    auto push = [&](int64_t j) {
      const T* fk = hybrid::key_meeting_state(s, it, j, w);
      for (int64_t f = 0; f < m; ++f) {
        const T* row = w.state.data() + f * dv;
        T acc = w.z[f];
        const T fkj = fk[f];
        for (int64_t t = 0; t < dv; ++t) {
          acc += row[t] * it.v[j * dv + t];
          dvv[j * dv + t] += row[t] * fkj;
        }
        dfk[j * m + f] += favor ? fkj * acc : acc;
      }
    };
    hybrid::clear_state(w, s);
    // Decayed: the query's term weighed by e^{λ(p_i − j)}, one factor e^{λ} more at each key back.
    for (int64_t j = it.L - 1, i0 = nq; j >= first; --j) {  // queries with window_begin > j: a suffix
      if (it.decayed() && i0 < nq) hybrid::scale_state(w, s, it.decay(1));
      while (i0 > 0 && hybrid::row_keys(s, i0 - 1, it.L).window_begin > j) {
        --i0;
        hybrid::add_outer(w.state.data(), w.z.data(), hybrid::query_entering(s, it, i0, w), g + i0 * dv, c[i0], m,
                          dv, it.decay(i0 + offset - j));
      }
      if (i0 < nq) push(j);
    }
    if (!s.opts.causal && s.opts.window > 0) {
      hybrid::clear_state(w, s);
      for (int64_t i = nq - 1, pos = it.L; i >= 0; --i) {
        const hybrid::RowKeys r = hybrid::row_keys(s, i, it.L);
        while (pos > r.suffix_begin) {
          --pos;
          hybrid::add_outer(w.state.data(), w.z.data(), hybrid::key_entering(s, it, pos, w), it.v + pos * dv, T(1),
                            m, dv);
        }
        if (pos < it.L) pull(i);
      }
      hybrid::clear_state(w, s);
      for (int64_t j = 0, i1 = 0; j < it.L; ++j) {  // queries with suffix_begin <= j: a prefix
        while (i1 < nq && hybrid::row_keys(s, i1, it.L).suffix_begin <= j) {
          hybrid::add_outer(w.state.data(), w.z.data(), hybrid::query_entering(s, it, i1, w), g + i1 * dv, c[i1], m,
                            dv);
          ++i1;
        }
        if (i1 > 0) push(j);
      }
    }
    // Through the feature map, into dq and dk (before the window adds to them: the maps'
    // backwards write their results): the plain maps' (FeatureMap::features_backward), or FAVOR's
    // L = ω·x̃ − ‖x̃‖²/2 (FeatureMap::logits_backward).
    if (favor) {
      favor->logits_backward(it.q, nq, Side::QueryWithNorm, dfq, nullptr, nullptr, dq, w.map_scratch.data());
      if (it.L > 0) favor->logits_backward(it.k, it.L, Side::Key, dfk, nullptr, nullptr, dk, w.map_scratch.data());
    } else if (!given) {
      const FeatureMap<T> map = hybrid::plain_map<T>(fn, s);
      map.features_backward(it.q, nq, it.fq, dfq, dq);
      map.features_backward(it.k, it.L, it.fk, dfk, dk);
    }
    // The window: weights γ e^{s_ij − M_i}, or with FAVOR γ e^{s_ij − R_i} (R_i only a shift of
    // the whole row: no gradient).
    double dgam = 0;
    for (int64_t i = 0; i < nq; ++i) {
      const hybrid::RowKeys r = hybrid::row_keys(s, i, it.L);
      const int64_t count = r.exact_count();
      if (count == 0) continue;
      const hybrid::WindowWeights<T> ww = hybrid::window_weights(s, it, i, r, w);
      const T unshift = favor ? std::exp(ww.max_score - w.shift[i]) : T(1);  // e^{M_i − R_i} <= 1
      T* e = w.scores.data();  // becomes ds_ij
      T shift = 0;
      for (int64_t j = 0; j < count; ++j) {
        const int64_t key = r.exact_key(j);
        const T gv = simd::dot(g + i * dv, it.v + key * dv, static_cast<size_t>(dv));
        const T ej = e[j] * unshift;
        const T a = it.gamma * ej;
        for (int64_t t = 0; t < dv; ++t) dvv[key * dv + t] += a * g[i * dv + t];
        dgam += static_cast<double>(ej) * static_cast<double>(gv + c[i]);
        e[j] = a * (gv + c[i]);
        shift -= e[j];
      }
      if (!favor) e[ww.top] += shift;  // ∂M_i: the maximum's score carries −Σ_j ds_ij
      for (int64_t j = 0; j < count; ++j) {
        const int64_t key = r.exact_key(j);
        const T a = sc * e[j];
        for (int64_t t = 0; t < hd; ++t) {
          dq[i * hd + t] += a * it.k[key * hd + t];
          dk[key * hd + t] += a * it.q[i * hd + t];
        }
      }
    }
    dgamma[static_cast<size_t>(bh)] = dgam;
  });
  if (given) {
    grads.params.emplace_back("query_features", std::move(dfq_all));
    grads.params.emplace_back("key_features", std::move(dfk_all));
  }
  if (in.window_gate) {
    // γ = sigmoid(g): dγ/dg = γ(1 − γ); summed over the batch in a fixed order.
    Tensor<T> dg({d.heads});
    for (int64_t h = 0; h < d.heads; ++h) {
      double acc = 0;
      for (int64_t b = 0; b < d.batch; ++b) acc += dgamma[static_cast<size_t>(b * d.heads + h)];
      const double gam = s.gamma[static_cast<size_t>(h)];
      dg[h] = static_cast<T>(acc * gam * (1 - gam));
    }
    grads.params.emplace_back("window_gate", std::move(dg));
  }
  restore_gradients(fn, grads, vs.exponent(), gs.exponent());
  return grads;
}

#define LINATTN_INSTANTIATE(T)                                                                                  \
  template hybrid::Setup hybrid::check_args<T>(const char*, TensorView<const T>, TensorView<const T>,          \
                                               TensorView<const T>, const HybridInputs<T>&,                    \
                                               const HybridAttentionOptions&);                                 \
  template Tensor<T> hybrid_attention<T>(TensorView<const T>, TensorView<const T>, TensorView<const T>,        \
                                         const HybridInputs<T>&, const HybridAttentionOptions&);               \
  template AttentionGrads<T> hybrid_attention_backward<T>(TensorView<const T>, TensorView<const T>,            \
                                                          TensorView<const T>, TensorView<const T>,            \
                                                          const HybridInputs<T>&, const HybridAttentionOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
