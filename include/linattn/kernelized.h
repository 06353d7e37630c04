// Kernelized (linear) attention and Performer / FAVOR+:
//   out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / (Σ_j φ(q_i)·φ(k_j) + eps)
// over the keys query i sees. O(n) time and memory.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "linattn/attention.h"
#include "linattn/tensor.h"

namespace linattn {

// causal: query i sees keys j <= i (needs n_q == n_k; for decoding use RecurrentState).
// scale: not used by these maps (they take q and k as they are); setting it is an error.
// feature_map "given" was called "identity" until 0.2 (issue 43: one name with hybrid_attention's
// "given"). Every function here still takes the old name for one release, as the new; the Python
// layers warn (OptionInfo::former_choices).
inline constexpr const char* kFormerGivenName = "identity";

struct LinearAttentionOptions : AttentionOptions {
  std::string feature_map = "elu";  // "elu" (elu(x)+1), "relu", "focused", or "given" (q and k
                                    // are features already, each >= 0: a map of the caller's)
  double eps = 1e-6;                // added to every denominator (>= 0, finite)
  double focus_power = 3;           // p of the "focused" map (>= 1, finite)
};

// scale: approximates softmax(q·kᵀ·scale); default 1/sqrt(d), must be > 0.
struct FavorOptions : AttentionOptions {
  std::string kernel = "positive";  // "positive" (FAVOR+), "hyperbolic", "trig"
};

// A forward's output and what its backward reuses instead of computing the forward again (as
// exact attention keeps its log-sum-exp); m' is the feature dimension (linear: head_dim; FAVOR:
// num_features, twice that for the hyperbolic and trig kernels).
template <class T>
struct KernelizedAttentionResult {
  Tensor<T> out;    // [B,H,n_q,d_v]
  // [B,H,n_q]: each row's normaliser φ(q_i)·Σ_j φ(k_j) + eps, in the engine's scale (FAVOR:
  // divided by exp(t_i) and the key shifts' factors, so it is not the plain sum).
  Tensor<T> den;
  // [B,H,m',d_v+2]: per feature r, [Σ_j φ_r(k_j)·v_j | Σ_j φ_r(k_j) | c_r] over every valid key,
  // the sums divided by exp(c_r) (FAVOR's per-feature shift; −inf where no key reaches the
  // feature, 0 for plain maps) and v in the units the engine computed in. Only the non-causal
  // backward reads it.
  Tensor<T> state;
};

// q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v] -> out [B,H,n_q,d_v].
// conv_weight [heads, K]: adds a depthwise convolution of v along the sequence (n_q == n_k):
// out[i] += Σ_t w[h,t]·v[i+t−(K−1)/2] (K odd) or, causal, Σ_t w[h,t]·v[i+t−(K−1)]; v is 0
// outside the sequence and at padded positions.
template <class T>
Tensor<T> linear_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                           const LinearAttentionOptions& opts = {},
                           std::optional<TensorView<const T>> conv_weight = std::nullopt);

// The same output, with what the backward reuses.
template <class T>
KernelizedAttentionResult<T> linear_attention_with_saved(
    TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
    const LinearAttentionOptions& opts = {},
    std::optional<TensorView<const T>> conv_weight = std::nullopt);
// Gradients dq, dk, dv and, with a conv_weight, params {"conv_weight"}. This overload computes
// the forward first.
template <class T>
AttentionGrads<T> linear_attention_backward(
    TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<const T> dout,
    const LinearAttentionOptions& opts = {},
    std::optional<TensorView<const T>> conv_weight = std::nullopt);
// Same, from linear_attention_with_saved's out, den and state (with a conv_weight, out holds
// the convolution too, so the attention part of it is computed again from state and den).
template <class T>
AttentionGrads<T> linear_attention_backward(
    TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<const T> dout,
    TensorView<const T> out, TensorView<const T> den, TensorView<const T> state,
    const LinearAttentionOptions& opts = {},
    std::optional<TensorView<const T>> conv_weight = std::nullopt);

// projection ω [m, d] (see random_features) -> out [B,H,n_q,d_v] ≈ softmax attention.
template <class T>
Tensor<T> favor_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                          TensorView<const T> projection, const FavorOptions& opts = {});

template <class T>
KernelizedAttentionResult<T> favor_attention_with_saved(TensorView<const T> q, TensorView<const T> k,
                                                        TensorView<const T> v,
                                                        TensorView<const T> projection,
                                                        const FavorOptions& opts = {});
// Gradients dq, dk, dv (the projection is a constant: no gradient). This overload computes the
// forward first.
template <class T>
AttentionGrads<T> favor_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                           TensorView<const T> v, TensorView<const T> projection,
                                           TensorView<const T> dout, const FavorOptions& opts = {});
// Same, from favor_attention_with_saved's out, den and state.
template <class T>
AttentionGrads<T> favor_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                           TensorView<const T> v, TensorView<const T> projection,
                                           TensorView<const T> dout, TensorView<const T> out,
                                           TensorView<const T> den, TensorView<const T> state,
                                           const FavorOptions& opts = {});

// ---- decoding ---------------------------------------------------------------------------------

struct RecurrentOptions {
  std::string feature_map = "elu";    // "elu", "relu", "focused", "given" or "favor"
  std::optional<std::string> kernel;  // favor only: "positive" (default), "hyperbolic", "trig"
  std::optional<double> scale;        // favor only: default 1/sqrt(head_dim)
  double eps = 1e-6;                  // elu/relu/focused/given: as linear_attention (favor: 0)
  double focus_power = 3;             // focused only
};

// ---- feature maps on their own ----------------------------------------------------------------
// The maps the attention functions apply, by the same code (one formula for C++, NumPy, torch
// and the Python decoding and context-parallel layers, which call these). Rows x [B,H,n,d],
// finite. Options as RecurrentOptions; eps is not used.

// Plain maps: feature_map "elu" (elu(x) + 1), "relu", "focused" (‖r‖·rᵖ/‖rᵖ‖, r = relu(x),
// p = focus_power) or "given" (x itself, which must be >= 0) -> φ(x) [B,H,n,d].
template <class T>
Tensor<T> features(TensorView<const T> x, const RecurrentOptions& opts = {});
// dx = (∂φ/∂x)ᵀ·dphi [B,H,n,d] for dphi [B,H,n,d] (finite).
template <class T>
Tensor<T> features_backward(TensorView<const T> x, TensorView<const T> dphi, const RecurrentOptions& opts = {});

// A plain map's largest feature for rows of head_dim values of largest |value| x_max (the
// bound the kernels refuse out-of-range inputs by, before they compute; the context-parallel
// layer checks each rank's keys by it before any collective). feature_map: a plain map's name;
// throws Error otherwise.
double plain_feature_bound(const std::string& feature_map, double x_max, int64_t head_dim);

// FAVOR's maps in log form (feature_map "favor", kernel, scale, projection ω [m, d]): φ = s·exp(L)
// up to a factor shared by every row and feature. With U = x̃·ωᵀ, x̃ = √scale·x, h = ‖x̃‖²/2:
//   side "key", "query_with_norm": positive L = U − h; hyperbolic [U − h, −U − h]; trig L = h
//   side "query" (h cancels):      positive L = U;     hyperbolic [U, −U];         trig L = 0
// and for trig s = [sin U, cos U] (factors; empty [B,H,n,0] for the others). "query_with_norm" is
// a query whose weights share a normaliser with exact ones (the sliding-window hybrid's).
template <class T>
struct FeatureLogits {
  Tensor<T> logits;   // [B,H,n,m']
  Tensor<T> factors;  // [B,H,n,m'] for trig; [B,H,n,0] otherwise
};
template <class T>
FeatureLogits<T> feature_logits(TensorView<const T> x, TensorView<const T> projection, const std::string& side,
                                const RecurrentOptions& opts);
// dx [B,H,n,d] from dlogits [B,H,n,m'] and, for trig, dfactors [B,H,n,m'] (nullopt: 0; refused for
// the other kernels). No gradient for the projection: it is a constant of the method.
template <class T>
Tensor<T> feature_logits_backward(TensorView<const T> x, TensorView<const T> projection, const std::string& side,
                                  TensorView<const T> dlogits, std::optional<TensorView<const T>> dfactors,
                                  const RecurrentOptions& opts);

// Hedgehog's learned map (Zhang et al., ICLR 2024; the map linattn.hf's conversions train):
// φ(x) = [softmax(x·W_h + b_h), softmax(−(x·W_h + b_h))] over the feature axis, per head h:
// x [B,H,n,d], weight [H,d,f], bias [H,f] (all finite) -> [B,H,n,2f]. Each half is shifted by its
// maximum and sums to 1, so φ(q)·φ(k) lies in (0, 2] whatever the inputs' size. The maps are
// trained parameters: the backward gives all three gradients.
template <class T>
Tensor<T> hedgehog_features(TensorView<const T> x, TensorView<const T> weight, TensorView<const T> bias);
template <class T>
struct HedgehogGrads {
  Tensor<T> dx;       // [B,H,n,d]
  Tensor<T> dweight;  // [H,d,f], summed over batch rows and positions in a fixed order
  Tensor<T> dbias;    // [H,f]
};
// The gradients of Σ dphi·φ for dphi [B,H,n,2f] (finite). phi: the forward's result, which the
// backward reads (saved by an autograd layer, as torch saves a softmax's output); made again
// from x when not given.
template <class T>
HedgehogGrads<T> hedgehog_features_backward(TensorView<const T> x, TensorView<const T> weight,
                                            TensorView<const T> bias, TensorView<const T> dphi,
                                            std::optional<TensorView<const T>> phi = std::nullopt);

// ---- state-level operations -------------------------------------------------------------------
// Kernelized attention in pieces, for a sequence split into blocks (context parallelism,
// linattn.torch.distributed; pipelines): the state of a block's keys, a state applied to
// queries, and a causal block that starts from the state of the keys before it. Each has its
// backward. A state is [B,H,m',d_v+2]: per feature r, the row
//   [S_r | z_r | c_r] = [Σ_j φ_r(k_j)·v_j | Σ_j φ_r(k_j)] / exp(c_r) | c_r
// over the keys it holds. c_r is a per-feature log-shift that keeps FAVOR's exponentials in
// range (the largest key logit of feature r; −inf where no key reached it, its S_r and z_r 0);
// it is 0 for the plain maps. Two states of the same options add as
//   c = max(c¹, c²),  [S | z] = [S¹ | z¹]·exp(c¹ − c) + [S² | z²]·exp(c² − c)
// (a term at c^i = −inf is 0). The shifts take no gradient: every attention output is the
// same function of q, k, v whatever they are (the query features take the same shifts back),
// so gradients of outputs through these operations are exact. A state's S and z on their own
// depend on k through c as well; their "gradient" here holds c constant.
// Options as RecurrentOptions: feature_map "elu", "relu", "focused", "given", or "favor"
// with a projection, kernel and scale. Every value of q, k and v must be finite (padded keys
// too; give them zeros). Values are not rescaled: sums that overflow the dtype are an error.
using StateOptions = RecurrentOptions;

template <class T>
struct StateAttentionResult {
  Tensor<T> out;    // [B,H,n,d_v]
  Tensor<T> den;    // [B,H,n]: each row's normaliser in the engine's scale (for the backward)
  Tensor<T> state;  // causal_from_state: the state after the block's keys (prefix included)
};

// The gradients of a state operation; empty where it has no such input.
template <class T>
struct StateGrads {
  Tensor<T> dq, dk, dv;
  Tensor<T> dstate;  // apply_state: of state; causal_from_state: of prefix (shift column 0)
};

// k [B,H,n,d], v [B,H,n,d_v] -> the state of the keys j < key_lengths[b] (default all).
template <class T>
Tensor<T> key_state(TensorView<const T> k, TensorView<const T> v, const StateOptions& opts = {},
                    std::optional<TensorView<const T>> projection = std::nullopt,
                    std::optional<std::vector<int64_t>> key_lengths = std::nullopt);
// dk, dv from dstate [B,H,m',d_v+2] (finite; its shift column is not read). state must be
// key_state's own result for these k and v: its shifts are the ones the gradient is taken at
// (S and z are divided by exp(c), and c is held constant), so another state's shifts would
// scale the gradients by exp(c_forward − c_given).
template <class T>
StateGrads<T> key_state_backward(TensorView<const T> k, TensorView<const T> v, TensorView<const T> state,
                                 TensorView<const T> dstate, const StateOptions& opts = {},
                                 std::optional<TensorView<const T>> projection = std::nullopt,
                                 std::optional<std::vector<int64_t>> key_lengths = std::nullopt);

// q [B,H,n,d], state -> out_i = φ(q_i)·S / (φ(q_i)·z + eps) [B,H,n,d_v] (0 where the
// denominator is 0), and den.
template <class T>
StateAttentionResult<T> apply_state(TensorView<const T> q, TensorView<const T> state, const StateOptions& opts = {},
                                    std::optional<TensorView<const T>> projection = std::nullopt);
// dq and dstate from dout and apply_state's out and den.
template <class T>
StateGrads<T> apply_state_backward(TensorView<const T> q, TensorView<const T> state, TensorView<const T> dout,
                                   TensorView<const T> out, TensorView<const T> den, const StateOptions& opts = {},
                                   std::optional<TensorView<const T>> projection = std::nullopt);

// q, k [B,H,n,d], v [B,H,n,d_v], prefix: the state of the keys before this block ->
// out_i = φ(q_i)·(S_P + Σ_{j<=i} φ(k_j)v_jᵀ) / (φ(q_i)·(z_P + Σ_{j<=i} φ(k_j)) + eps), den, and
// the state after the block (prefix and the keys j < key_lengths[b]).
template <class T>
StateAttentionResult<T> causal_from_state(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                          TensorView<const T> prefix, const StateOptions& opts = {},
                                          std::optional<TensorView<const T>> projection = std::nullopt,
                                          std::optional<std::vector<int64_t>> key_lengths = std::nullopt);
// dq, dk, dv and dstate (of prefix) from dout, the forward's out and den, and the gradient of
// the state after the block (nullopt: none reaches it).
template <class T>
StateGrads<T> causal_from_state_backward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                         TensorView<const T> prefix, TensorView<const T> dout,
                                         TensorView<const T> out, TensorView<const T> den,
                                         std::optional<TensorView<const T>> dstate_after = std::nullopt,
                                         const StateOptions& opts = {},
                                         std::optional<TensorView<const T>> projection = std::nullopt,
                                         std::optional<std::vector<int64_t>> key_lengths = std::nullopt);

// Constant-size state for autoregressive decoding with kernelized attention: after any number
// of tokens it holds S = Σ_j φ(k_j) v_jᵀ [m'×d_v] and z = Σ_j φ(k_j) [m'] per (batch, head),
// and for FAVOR per-feature log-shifts (row r of S and z is stored divided by exp(c_r),
// rescaled when a larger key exponent arrives), so decoding never overflows and never looks
// ahead. One state holds one batch of sequences: prefill, step and copy refuse (Error) while
// another thread is inside one of them on the same state.
template <class T>
class RecurrentState {
 public:
  // projection ω [m, head_dim] is required for "favor" and refused otherwise; it is copied.
  RecurrentState(int64_t batch, int64_t heads, int64_t head_dim, int64_t value_dim,
                 const RecurrentOptions& opts = {},
                 std::optional<TensorView<const T>> projection = std::nullopt);
  RecurrentState(RecurrentState&&) noexcept;
  RecurrentState& operator=(RecurrentState&&) noexcept;
  ~RecurrentState();

  // q, k, v [B,H,n,d|d_v] -> out [B,H,n,d_v]: the causal outputs of these n tokens after all
  // tokens seen so far (chunked), leaving the state after them.
  Tensor<T> prefill(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v);
  // q_t, k_t [B,H,d], v_t [B,H,d_v] -> out [B,H,d_v]; O(m'·d_v) per (batch, head). Exactly
  // what prefill gives for the same token.
  Tensor<T> step(TensorView<const T> q_t, TensorView<const T> k_t, TensorView<const T> v_t);
  // An independent copy (to roll back to, or for another thread).
  RecurrentState copy() const;

  int64_t tokens() const;       // tokens consumed so far
  int64_t feature_dim() const;  // m'

 private:
  struct Impl;
  explicit RecurrentState(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The state for decoding, by the name the Python module uses.
template <class T>
RecurrentState<T> recurrent_state(int64_t batch, int64_t heads, int64_t head_dim,
                                  int64_t value_dim, const RecurrentOptions& opts = {},
                                  std::optional<TensorView<const T>> projection = std::nullopt) {
  return RecurrentState<T>(batch, heads, head_dim, value_dim, opts, projection);
}

}  // namespace linattn
