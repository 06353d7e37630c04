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
  // "elu" (elu(x)+1), "relu" or "focused" (‖r‖·rᵖ/‖rᵖ‖, r = relu(x), p = focus_power: focused
  // linear attention's map) of q and k; "given": query_features and key_features are the
  // features (non-negative, from a map of the caller's: Hedgehog's); "favor": FAVOR+'s random
  // features of q and k with the `projection` input, which estimate e^{s_ij} itself, so the
  // window's weights are then unshifted (see below and docs/methods/hybrid.md).
  std::string feature_map = "elu";
  // feature_map == "favor": "positive" (exp(ω·x̃ − ‖x̃‖²/2)/√m) or "hyperbolic" (±ω, 2m
  // features). Any other value than the default with another map is an error.
  std::string kernel = "positive";
  // feature_map == "focused": p, finite, in [1, 1000]. Any other value than the default with
  // another map is an error.
  double focus_power = 3;
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

// Decoding (linattn.hf's LinattnCache): the causal hybrid's state after the tokens of each batch
// row so far, made by hybrid_prefill and changed in place by hybrid_decode_step (features given,
// or made by the call: Hedgehog's maps, a fixed map, FAVOR's projection). Rows may hold different numbers of tokens (padding).
template <class T>
struct HybridDecodeState {
  TensorView<T> sums;           // [B, H, m', d_v]: Σ φ(k_j) v_jᵀ over the keys that left the window, decayed
  TensorView<T> normaliser;     // [B, H, m']: Σ φ(k_j), the same keys
  TensorView<T> exact_keys;     // [B, H_kv, s + w, d]: s sink slots (slot p: the row's token p once it
                                //   has left the window), then a ring of w (token p at slot s + p mod w);
                                //   per key/value head (H_kv divides H; query head h reads h / (H / H_kv))
  TensorView<T> exact_values;   // [B, H_kv, s + w, d_v]
  TensorView<bool> exact_valid;  // [B, s + w]: the slots holding a token
  TensorView<int64_t> counts;   // [B]: the tokens of each row so far
  // FAVOR's features only (empty for plain ones): [B, H, m'], the sums' per-feature scale c_r
  // (−inf while no key has entered them): they hold Σ_j s_jr e^{L_jr + λ·a_j − c_r} v_j and
  // Σ_j s_jr e^{L_jr + λ·a_j − c_r}, a_j key j's distance to the last token, every weight <= 1.
  // A step raises c_r to cover the key entering and multiplies the sums by e^{λ}, leaving c_r
  // (the forward's scheme); a prefill sets c_r = max_j (L_jr + λ·a_j). Only S·e^{c} means anything.
  TensorView<T> shift = {};
};

struct HybridDecodeOptions {
  // w >= 0; 0: linear attention alone (no exact slots, s = 0): the new token's key enters the
  // sums at once, and leaving_features are its features
  int64_t window = 64;
  int64_t sinks = 0;  // s >= 0
  double scale = 0;     // the scores' scale, finite
  double eps = 1e-6;    // finite, >= 0
  // "given": query_features and leaving_features are the features; "elu", "relu" or "focused"
  // (focus_power): a fixed map (features() in kernelized.h) that the step applies to q and to the
  // leaving key itself, m' = d; then both feature views must be empty.
  std::string feature_map = "given";
  double focus_power = 3;
  // feature_map "favor" (the FavorFeatures overloads): "positive" or "hyperbolic", and without a
  // window also "trig". Its x̃ = √scale·x takes the scores' scale.
  std::string kernel = "positive";
};

// FAVOR+'s random features made by the step and the prefill themselves: the projection ω [m, d]
// (finite; random_features), with opts.feature_map = "favor" and opts.kernel. Keys' and queries'
// logits are both the key form (feature_logits in kernelized.h, "query_with_norm" for queries:
// a query's −‖x̃‖²/2 does not cancel against the window's exact weights or eps), as in
// hybrid_attention.
template <class T>
struct FavorFeatures {
  TensorView<const T> projection;
};

// One token of every batch row where advance[b]: q [B, H, d], k [B, H_kv, d], v [B, H_kv, d_v]
// (grouped queries: H_kv key/value heads, each read by H / H_kv query heads; H_kv = H without),
// query_features φ(q) [B, H, m'], leaving_features [B, H, m'] (φ of the key in ring slot
// s + counts[b] mod w, which leaves the window now when counts[b] >= w; read only then),
// window_weight γ [H] in [0, 1], log_decay λ [H] (each <= 0; empty: none). The token that
// leaves the window enters the sums (weighed by e^{λ·w}; after the sums decayed by e^{λ}) or,
// when it is one of the row's first s tokens, its sink slot; the new token takes its ring slot;
// then out[b, h] = (γ_h Σ_j e^{s_j − M} v_j + φ(q)ᵀ sums) / (γ_h Σ_j e^{s_j − M} + φ(q)·normaliser
// + eps) over the valid exact slots j (s_j = scale·q·k_j, M their maximum), the causal
// hybrid_attention's row for the token; counts[b] += 1. A row with advance[b] false gets 0 and
// its state is not touched. Every argument is checked before anything is written: an Error
// names the first bad one and the state is as it was.
template <class T>
Tensor<T> hybrid_decode_step(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                             TensorView<const T> query_features, TensorView<const T> leaving_features,
                             TensorView<const bool> advance, TensorView<const T> window_weight,
                             TensorView<const T> log_decay, const HybridDecodeState<T>& state,
                             const HybridDecodeOptions& opts);

// Hedgehog's learned maps of every query head (hedgehog_features in kernelized.h): the query
// map's and the key map's weights [H, d, f] and biases [H, f], finite.
template <class T>
struct HedgehogMaps {
  TensorView<const T> query_weight, query_bias, key_weight, key_bias;
};
// The same step with Hedgehog's maps applied here, so that a converted model's layer is one call
// per token: query_features = φ_q(q) and leaving_features = φ_k(the key in the leaving ring slot,
// for each query head's key map), m' = 2f. opts.feature_map must be "given" (the default).
template <class T>
Tensor<T> hybrid_decode_step(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                             const HedgehogMaps<T>& maps, TensorView<const bool> advance,
                             TensorView<const T> window_weight, TensorView<const T> log_decay,
                             const HybridDecodeState<T>& state, const HybridDecodeOptions& opts);

// The same step with FAVOR's features in log form (opts.feature_map "favor", state.shift given):
// the key entering the sums raises the shifts to cover its logits, the query reads them on the
// scale e^{R}, R = max(the window's largest score, max_r L_q,r + c_r), and out = (γ Σ_j e^{s_j − R}
// v_j + e^{−R}Σ_r φ_r(q) S_r) / (γ Σ_j e^{s_j − R} + e^{−R}Σ_r φ_r(q) z_r + eps·e^{−R}) with φ(q)·φ(k)
// = Σ_r e^{L_q,r + L_k,r}/m' (hybrid_attention's FAVOR rows; without a window and with eps = 0
// favor_attention's); a zero denominator gives 0.
template <class T>
Tensor<T> hybrid_decode_step(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                             const FavorFeatures<T>& favor, TensorView<const bool> advance,
                             TensorView<const T> window_weight, TensorView<const T> log_decay,
                             const HybridDecodeState<T>& state, const HybridDecodeOptions& opts);

// The state after a prompt, written over `state` (whatever it held): the state
// hybrid_decode_step continues from, as if the prompt's tokens had been stepped through it from
// the empty state (LinattnCache's prefill: the prompt's outputs come from the forward, its state
// from here, in one call per layer). k [B, H_kv, n, d], v [B, H_kv, n, d_v]; valid [B, n] marks
// each row's tokens (empty: every position; padding goes nowhere); key_features [B, H, n, m']:
// φ of each query head's map on its key head's keys, or empty when opts.feature_map names a
// fixed map (applied here, m' = d); log_decay λ [H] (each <= 0; empty: none). H and m' are the
// sums' [B, H, m', d_v]. Of a row's c tokens (place i = 0, ..., c − 1), the last w take ring
// slots s + i mod w; of the others, the first s take sink slots i and the rest enter the sums
// and the normaliser weighed by e^{λ_h·(c − 1 − i)}; counts[b] = c. opts.eps is not used, nor
// opts.scale but by FAVOR. Every argument is checked before anything is written.
template <class T>
void hybrid_prefill(TensorView<const T> k, TensorView<const T> v, TensorView<const T> key_features,
                    TensorView<const bool> valid, TensorView<const T> log_decay, const HybridDecodeState<T>& state,
                    const HybridDecodeOptions& opts);
// The same with Hedgehog's key map applied here (key_weight [H, d, f], key_bias [H, f]; the
// formula hedgehog_features runs), m' = 2f. opts.feature_map must be "given" (the default).
template <class T>
void hybrid_prefill(TensorView<const T> k, TensorView<const T> v, TensorView<const T> key_weight,
                    TensorView<const T> key_bias, TensorView<const bool> valid, TensorView<const T> log_decay,
                    const HybridDecodeState<T>& state, const HybridDecodeOptions& opts);
// The same with FAVOR's features (opts.feature_map "favor", opts.kernel, opts.scale): the sums in
// log form, state.shift (given) set to each feature's largest decayed key logit.
template <class T>
void hybrid_prefill(TensorView<const T> k, TensorView<const T> v, const FavorFeatures<T>& favor,
                    TensorView<const bool> valid, TensorView<const T> log_decay, const HybridDecodeState<T>& state,
                    const HybridDecodeOptions& opts);

}  // namespace linattn
