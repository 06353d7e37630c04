// Gated (decayed) linear attention, state in and state out (docs/methods/gated.md):
//   S_t = diag(exp(g_t))·S_{t−1} + k_t v_tᵀ   (S [d_k, d_v], S_0 the initial state or 0)
//   o_t = scale · S_tᵀ q_t
// with log-gates g ≤ 0 per head (RetNet's decay, GLA's scalar form: log_gate [B, H, n]) or per
// head and channel (GLA: log_gate [B, H, n, d_k]); no normaliser (models normalise their
// outputs). Computed in chunks of 64 positions: the intra-chunk part as small products with the
// decay matrix (per channel one product of rows scaled within e^{±10} where the chunk's gates
// decay little, else sub-blocks of 16 referenced to a point between them, so no factor exceeds
// 1), the inter-chunk part as a product with the state.
//
// causal = false: every output reads every position, decayed both ways,
//   o_t = scale · Σ_s (q_t ⊙ e_ts)ᵀ k_s v_s,  e_ts = Π_{min(s,t) < u <= max(s,t)} exp(g_u)
// (RetNet's bidirectional γ^{|t−s|} for a constant gate; Hydra's two scans with shared gates):
// the causal form plus the causal form of the reversed sequence, the diagonal counted once.
// It has no state: initial_state and dstate must be empty, and the result's state is empty.
#pragma once

#include <optional>

#include "linattn/tensor.h"

namespace linattn {

struct GatedLinearAttentionOptions {
  std::optional<double> scale;  // None: 1/sqrt(d_k); finite otherwise
  bool causal = true;           // false: decayed both ways (above); no state in or out
};

template <class T>
struct GatedLinearAttentionResult {
  Tensor<T> out;    // [B, H, n, d_v]
  Tensor<T> state;  // S_n [B, H, d_k, d_v]; empty (shape [0]) when causal is false
};

template <class T>
struct GatedLinearAttentionGrads {
  Tensor<T> dq, dk, dv;
  Tensor<T> dlog_gate;      // the shape of log_gate
  Tensor<T> dinitial_state; // [B, H, d_k, d_v] (zeros' gradient when no initial state was given)
};

// q, k [B, H, n, d_k], v [B, H, n, d_v] finite; log_gate [B, H, n] or [B, H, n, d_k], each
// value <= 0 or −inf (a reset), never NaN; initial_state empty (data null) or [B, H, d_k, d_v]
// finite. Error naming the argument otherwise. Log-gates below −1000 act as −1000: exp of
// either is 0 in float64, and cumulative sums stay exact enough for the decay factors.
template <class T>
GatedLinearAttentionResult<T> gated_linear_attention(TensorView<const T> q, TensorView<const T> k,
                                                     TensorView<const T> v, TensorView<const T> log_gate,
                                                     TensorView<const T> initial_state,
                                                     const GatedLinearAttentionOptions& opts = {});

// The gradients for dout [B, H, n, d_v] and (optional, data null for none) dstate, the
// gradient of the returned final state [B, H, d_k, d_v].
template <class T>
GatedLinearAttentionGrads<T> gated_linear_attention_backward(
    TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<const T> log_gate,
    TensorView<const T> initial_state, TensorView<const T> dout, TensorView<const T> dstate,
    const GatedLinearAttentionOptions& opts = {});

}  // namespace linattn
