// Efficient Attention (Shen et al., 2021): softmax over features for queries, over positions
// for keys,  out = softmax_d(Q·s) · (softmax_n(K·s)ᵀ V),  s default 1/sqrt(head_dim).
// O(n·d·d_v) time, O(n·d) memory. Never causal: the key softmax normalises over all positions.
#pragma once

#include <optional>
#include <vector>

#include "linattn/attention.h"
#include "linattn/kernelized.h"
#include "linattn/tensor.h"

namespace linattn {

// key_lengths: padded keys leave the softmax over positions. causal = true is an error: there
// is no causal Efficient Attention.
struct EfficientAttentionOptions : AttentionOptions {};

// q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v] -> out [B,H,n_q,d_v].
template <class T>
Tensor<T> efficient_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                              const EfficientAttentionOptions& opts = {});

template <class T>
AttentionGrads<T> efficient_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                               TensorView<const T> v, TensorView<const T> dout,
                                               const EfficientAttentionOptions& opts = {});

// ---- state-level operations --------------------------------------------------------------------
// Efficient Attention over a sequence split into blocks (linattn.torch.distributed): the context
// state of a block's keys, and queries against a state. A state is [B,H,d,d_v+2] in the
// kernelized states' layout (kernelized.h): per feature r, the row
//   [S_r | z_r | c_r] = [Σ_j e_jr·v_j | Σ_j e_jr | c_r],  e_jr = exp(s·k_jr − c_r),
// over the keys it holds, c_r = max_j s·k_jr (−inf, with S_r and z_r 0, where it holds none).
// States add as kernelized states do (c = max, [S | z] rescaled by exp(c_i − c) and summed), and
// the whole sequence's state applied to the queries is efficient_attention:
//   out_i = softmax_d(s·q_i)·G,  G_r = S_r / z_r  (0 where z_r = 0: no key at all).
// The shifts take no gradient (out does not depend on them; S and z's gradients hold c
// constant). s = opts.scale, default 1/sqrt(d); opts.causal must be false. Values are not
// rescaled: sums beyond the dtype's range are an error.

// k [B,H,n,d], v [B,H,n,d_v] -> the state of the keys j < opts.key_lengths[b] (default all).
template <class T>
Tensor<T> efficient_key_state(TensorView<const T> k, TensorView<const T> v, const EfficientAttentionOptions& opts = {});
// dk, dv (padded keys 0) from dstate [B,H,d,d_v+2] (finite; its shift column is not read), with
// `state` the forward's own (its shifts are the ones the gradient is taken at).
template <class T>
StateGrads<T> efficient_key_state_backward(TensorView<const T> k, TensorView<const T> v, TensorView<const T> state,
                                           TensorView<const T> dstate, const EfficientAttentionOptions& opts = {});
// q [B,H,n,d] and a state -> out [B,H,n,d_v]. opts.key_lengths must be unset (the state holds
// the keys).
template <class T>
Tensor<T> efficient_apply_state(TensorView<const T> q, TensorView<const T> state, const EfficientAttentionOptions& opts = {});
// dq and dstate (shift column 0) from dout.
template <class T>
StateGrads<T> efficient_apply_state_backward(TensorView<const T> q, TensorView<const T> state, TensorView<const T> dout,
                                             const EfficientAttentionOptions& opts = {});

}  // namespace linattn
