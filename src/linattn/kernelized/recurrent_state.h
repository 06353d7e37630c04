// Constant-size state for autoregressive decoding with kernelized attention: after any number
// of tokens it holds S = Σ_j φ(k_j) v_jᵀ [m'×d_v] and z = Σ_j φ(k_j) [m'] per (batch, head),
// and for FAVOR per-feature log-shifts c [m'] (row r of S and z is stored divided by exp(c_r),
// rescaled when a larger key exponent arrives), so decoding never overflows and never looks
// ahead.
#pragma once

#include <optional>
#include <string>

#include "linattn/core/tensor.h"
#include "linattn/core/threading.h"
#include "linattn/kernelized/feature_map.h"

namespace linattn {

struct RecurrentOptions {
  std::string feature_map = "elu";    // "elu", "relu", "focused" or "favor"
  std::optional<std::string> kernel;  // favor only: "positive" (default), "hyperbolic", "trig"
  std::optional<double> scale;        // favor only: default 1/sqrt(head_dim)
  double eps = 1e-6;                  // elu/relu/focused: as linear_attention (favor: 0)
  double focus_power = 3;             // focused only
};

template <class T>
class RecurrentState {
 public:
  // projection ω [m, head_dim] is required for "favor" and refused otherwise; it is copied.
  RecurrentState(int64_t batch, int64_t heads, int64_t head_dim, int64_t value_dim,
                 const RecurrentOptions& opts = {},
                 std::optional<TensorView<const T>> projection = std::nullopt);

  // q, k, v [B,H,n,d|d_v] -> out [B,H,n,d_v]: the causal outputs of these n tokens after all
  // tokens seen so far (chunked), leaving the state after them.
  Tensor<T> prefill(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v);
  // q_t, k_t [B,H,d], v_t [B,H,d_v] -> out [B,H,d_v]; O(m'·d_v) per (batch, head).
  Tensor<T> step(TensorView<const T> q_t, TensorView<const T> k_t, TensorView<const T> v_t);
  // An independent copy (to roll back to, or for another thread). prefill, step and copy
  // throw Error while another thread is inside one of them on the same state.
  RecurrentState copy() const;

  int64_t tokens() const { return tokens_; }  // tokens consumed so far
  int64_t feature_dim() const { return fmap_.dim(); }

 private:
  RecurrentState() = default;
  void rebuild_map();

  int64_t batch_ = 0, heads_ = 0, head_dim_ = 0, value_dim_ = 0, tokens_ = 0;
  RecurrentOptions opts_;
  Tensor<T> projection_;  // owned copy (favor)
  FeatureMap<T> fmap_;
  Tensor<T> S_, z_, c_;   // [B,H,m',d_v], [B,H,m'], [B,H,m']
  SingleUser user_;       // prefill, step and copy from two threads at once are refused
};

// The state for decoding, by the name the Python module uses.
template <class T>
RecurrentState<T> recurrent_state(int64_t batch, int64_t heads, int64_t head_dim,
                                  int64_t value_dim, const RecurrentOptions& opts = {},
                                  std::optional<TensorView<const T>> projection = std::nullopt) {
  return RecurrentState<T>(batch, heads, head_dim, value_dim, opts, projection);
}

}  // namespace linattn
