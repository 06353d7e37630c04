// Sliding-window + linear hybrid attention (LoLCATs, Zhang et al., ICLR 2025): each query attends
// with exact softmax to the keys in its window and through a feature map to every other key,
// with one shared normaliser:
//   out_i = (γ_h Σ_{j∈W(i)} e^{s_ij − M_i} v_j + Σ_{j∉W(i)} φ(q_i)·φ(k_j) v_j)
//           / (γ_h Σ_{j∈W(i)} e^{s_ij − M_i} + Σ_{j∉W(i)} φ(q_i)·φ(k_j) + eps),
//   s_ij = scale·q_i·k_j, M_i = max_{j∈W(i)} s_ij, γ_h = sigmoid(window_gate[h]) (1 without one).
// With FAVOR's features, which estimate e^{s_ij}, the window is not shifted (M_i = 0 above): the
// estimator of softmax with exact weights inside the window. It is computed with every term
// shifted by a per-row R_i and eps by e^{−R_i}, which changes nothing but the range.
// W(i): causal, the last `window` keys query i sees (its own included), and the first `sinks`
// keys (StreamingLLM's attention sinks: LLMs put much of their attention on the first tokens);
// not causal, the keys with |p_i − j| <= window (p_i = i + n_k − n_q, the query's position). window = 0: no window, plain
// linear attention. O(n·(w + m')·d) time, O(n) memory (docs/methods/hybrid.md).
// log_decay λ [H] (causal only, each ≤ 0): the linear part's term of key j in row i is weighed
// by e^{λ_h·(p_i − j)}, so its share stops growing with position (RetNet's decay on the linear
// part, as Liger and Lizard convert LLMs); the window and the sinks are not decayed.
#pragma once

#include <optional>
#include <string>

#include "linattn/attention.h"
#include "linattn/tensor.h"

namespace linattn {

struct HybridAttentionOptions : AttentionOptions {
  int64_t window = 64;
  // Causal only: the first `sinks` keys are in every query's exact part (once it sees them),
  // whatever the window. 0: none.
  int64_t sinks = 0;
  // "elu" (elu(x)+1) or "relu" of q and k; "given": query_features and key_features are the
  // features (non-negative, from a map of the caller's: Hedgehog's); "favor": FAVOR+'s random
  // features of q and k with the `projection` input, which estimate e^{s_ij} itself, so the
  // window's weights are then unshifted (see below and docs/methods/hybrid.md).
  std::string feature_map = "elu";
  // feature_map == "favor": "positive" (exp(ω·x̃ − ‖x̃‖²/2)/√m) or "hyperbolic" (±ω, 2m
  // features). Any other value than the default with another map is an error.
  std::string kernel = "positive";
  double eps = 1e-6;
};

// The tensors besides q, k, v: the features when feature_map == "given" ([B,H,n_q,m'] and
// [B,H,n_k,m']), FAVOR's projection ω [m, head_dim] when feature_map == "favor" (from
// random_features; not differentiated), the window gate g [H] (absent: γ = 1), and the linear
// part's per-head log-decay λ [H] (absent: none; not differentiated).
template <class T>
struct HybridInputs {
  std::optional<TensorView<const T>> query_features, key_features, window_gate, projection, log_decay;
};

// q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v] -> out [B,H,n_q,d_v].
template <class T>
Tensor<T> hybrid_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                           const HybridInputs<T>& inputs, const HybridAttentionOptions& opts = {});

// dq, dk, dv, and in params the gradients of the given inputs: "query_features",
// "key_features" (feature_map "given") and "window_gate" (when passed), in that order (none for
// the projection).
template <class T>
AttentionGrads<T> hybrid_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                            TensorView<const T> v, TensorView<const T> dout,
                                            const HybridInputs<T>& inputs,
                                            const HybridAttentionOptions& opts = {});

}  // namespace linattn
