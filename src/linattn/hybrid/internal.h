// What the hybrid's forward, backward and reference share: the checked call and the rows each
// query sees (internal).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/hybrid.h"
#include "linattn/core/feature_map.h"

namespace linattn::hybrid {

// A checked call: sizes, scale, the feature map and its width m', γ_h per head.
struct Setup {
  AttentionDims d;
  HybridAttentionOptions opts;
  double scale = 0;
  // The linear part's map. FAVOR's (positive or hyperbolic): random features in log form,
  // φ_r(x) = exp(L_r(x))/√m', which estimate e^{s_ij}, so the window is then unshifted and every
  // term of row i is shifted by R_i instead. Given: the caller's features. The others: φ of q
  // and k by the library's plain map (core/feature_map.h, the one place their formulas live).
  FeatureMapKind map = FeatureMapKind::Elu;
  int64_t features = 0;        // m'
  std::vector<double> gamma;   // [heads]: sigmoid(window_gate), or 1
  std::vector<double> log_decay;  // [heads]: λ_h, the linear part's decay per position; empty: none
  double feature_max_q = 0, feature_max_k = 0;  // largest feature of a query / a visible key

  bool favor() const { return map >= FeatureMapKind::FavorPositive; }
  bool given() const { return map == FeatureMapKind::Given; }
  bool own_features() const { return !favor() && !given(); }  // a plain map the kernel applies
};

// Checks everything (shapes, finiteness, non-negative given features, options, ranges); Error
// naming fn and the argument otherwise.
template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 const HybridInputs<T>& in, const HybridAttentionOptions& opts);

// The keys query i of an item with L visible keys sees, as boundaries: the sinks [0, sink_end)
// (exact, causal only), the linear prefix [sink_end, window_begin), the window
// [window_begin, window_end) and the linear suffix [suffix_begin, L) (not causal only; empty
// otherwise). Each is non-decreasing in i, which is what lets the states be swept once forwards
// and once backwards. The exact part is the sinks and the window: exact_count() keys, the j-th
// of them exact_key(j).
struct RowKeys {
  int64_t window_begin, window_end, suffix_begin, sink_end = 0;
  int64_t exact_count() const { return sink_end + window_end - window_begin; }
  int64_t exact_key(int64_t j) const { return j < sink_end ? j : window_begin + (j - sink_end); }
};

inline RowKeys row_keys(const Setup& s, int64_t i, int64_t L) {
  const int64_t p = i + s.d.n_k - s.d.n_q, w = s.opts.window;
  auto clamp = [L](int64_t x) { return std::clamp<int64_t>(x, 0, L); };
  if (s.opts.causal) {
    const int64_t end = clamp(p + 1), begin = clamp(p + 1 - w);
    return {begin, end, L, std::min(begin, clamp(s.opts.sinks))};
  }
  if (w == 0) return {L, L, L};
  const int64_t end = clamp(p + w + 1);
  return {clamp(p - w), end, end};
}

// FAVOR's feature map (the projection checked against head_dim, scale > 0); Error naming fn.
template <class T>
FeatureMap<T> favor_map(const char* fn, const Setup& s, const HybridInputs<T>& in) {
  return FeatureMap<T>::favor(fn, s.map, *in.projection, s.d.head_dim, s.opts.scale);
}

// The blocked path (blocked.cc): causal calls with n_q == n_k and features used as they are
// (elu, relu, focused, given) run their window on tiles of queries by products and their linear part on
// the chunked gated engine (gated.h); the others (FAVOR's per-row shifts, not causal, n_q != n_k)
// on hybrid.cc's sweeps. Both compute the same formula (hybrid.h), tested against one reference.
bool blocked_applies(const Setup& s);

// out [B,H,n,d_v] (v already range-scaled, the checked call s).
template <class T>
void blocked_forward(const Setup& s, TensorView<const T> q, TensorView<const T> k,
                     TensorView<const T> v, const HybridInputs<T>& in, const KeyMask& mask, T* out);

// Adds into grads.dq, dk, dv (zeros on entry); writes the given features' gradients into
// dfq_given, dfk_given (zeros on entry; feature_map "given" only) and Σ ∂/∂γ per item into dgamma.
template <class T>
void blocked_backward(const Setup& s, TensorView<const T> q, TensorView<const T> k,
                      TensorView<const T> v, TensorView<const T> dout, const HybridInputs<T>& in,
                      const KeyMask& mask, AttentionGrads<T>& grads, T* dfq_given, T* dfk_given,
                      std::vector<double>& dgamma);

// The plain map s.own_features() names (focus_power checked); Error naming fn.
template <class T>
FeatureMap<T> plain_map(const char* fn, const Setup& s) {
  return FeatureMap<T>::plain(fn, s.map, s.d.head_dim, s.opts.focus_power);
}

inline double sigmoid(double g) { return g >= 0 ? 1 / (1 + std::exp(-g)) : std::exp(g) / (1 + std::exp(g)); }

}  // namespace linattn::hybrid
