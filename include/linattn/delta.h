// The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-hybrid) and, with per-channel
// gates, Kimi Linear's KDA; state in and state out (docs/methods/delta.md):
//   S_t = (I − β_t k_t k_tᵀ)·diag(exp(g_t))·S_{t−1} + β_t k_t v_tᵀ   (S [d_k, d_v], S_0 given or 0)
//   o_t = scale · S_tᵀ q_t
// with log-gates g <= 0 per head (g [B, H, n]: Gated DeltaNet's α_t = exp(g_t)) or per head and
// channel (g [B, H, n, d_k]: KDA), and β_t in [0, 2] (OLMo-hybrid's allow_neg_eigval doubles a
// sigmoid; with unit keys every transition then has norm <= 1). Queries and keys may have fewer
// heads than values (grouped, as Qwen3.5): value head h reads query/key head h / (H / H_k).
// With use_qk_l2norm_in_kernel, q and k are first divided by sqrt(|x|² + 1e−6), as fla and
// transformers do. The state layout [B, H, d_k, d_v] is transformers'.
//
// Computed in chunks of 64 positions by the UT transform (DeltaNet, Yang et al. 2024): in a
// chunk from the state P the corrections u_t = β_t (v_t − (decayed state before t)ᵀ k_t) solve
// one unit lower triangular system, and then the chunk is gated linear attention with values u
// (its decays from the same layer, src/linattn/core/chunk_decay.h).
#pragma once

#include <optional>

#include "linattn/tensor.h"

namespace linattn {

struct GatedDeltaRuleOptions {
  std::optional<double> scale;            // None: 1/sqrt(d_k); finite otherwise
  bool use_qk_l2norm_in_kernel = false;   // q, k ← x / sqrt(|x|² + 1e−6) first (fla's l2norm)
};

template <class T>
struct GatedDeltaRuleResult {
  Tensor<T> out;    // [B, H, n, d_v]
  Tensor<T> state;  // S_n [B, H, d_k, d_v]
};

template <class T>
struct GatedDeltaRuleGrads {
  Tensor<T> dq, dk;          // [B, H_k, n, d_k]
  Tensor<T> dv;              // [B, H, n, d_v]
  Tensor<T> dg;              // the shape of g
  Tensor<T> dbeta;           // [B, H, n]
  Tensor<T> dinitial_state;  // [B, H, d_k, d_v] (zeros' gradient when no initial state was given)
};

// q, k [B, H_k, n, d_k] and v [B, H, n, d_v] finite, H a multiple of H_k; g [B, H, n] or
// [B, H, n, d_k], each value <= 0 or −inf (a reset: exp(g) = 0), never NaN; beta [B, H, n] in
// [0, 2]; initial_state empty (data null) or [B, H, d_k, d_v] finite. Error naming the argument
// otherwise, and nothing returned. Log-gates below −1000 act as −1000 (exp of either is 0 in
// float64).
template <class T>
GatedDeltaRuleResult<T> gated_delta_rule(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                         TensorView<const T> g, TensorView<const T> beta,
                                         TensorView<const T> initial_state, const GatedDeltaRuleOptions& opts = {});

// The gradients for dout [B, H, n, d_v] and (optional, data null for none) dstate, the gradient
// of the returned final state [B, H, d_k, d_v].
template <class T>
GatedDeltaRuleGrads<T> gated_delta_rule_backward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                                 TensorView<const T> g, TensorView<const T> beta,
                                                 TensorView<const T> initial_state, TensorView<const T> dout,
                                                 TensorView<const T> dstate, const GatedDeltaRuleOptions& opts = {});

}  // namespace linattn
