// Efficient Attention (Shen et al., 2021): softmax over features for queries, over positions
// for keys,  out = softmax_d(Q·s) · (softmax_n(K·s)ᵀ V),  s default 1/sqrt(head_dim).
// O(n·d·d_v) time, O(n·d) memory. Never causal: the key softmax normalises over all positions.
#pragma once

#include <optional>
#include <vector>

#include "linattn/attention.h"
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

}  // namespace linattn
