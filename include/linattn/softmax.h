// Exact softmax attention: out = softmax(q·kᵀ·scale + mask)·v, in O(n·d) extra memory.
#pragma once

#include "linattn/attention.h"
#include "linattn/tensor.h"

namespace linattn {

template <class T>
struct SoftmaxAttentionResult {
  Tensor<T> out;  // [B, H, n_q, d_v]
  Tensor<T> lse;  // [B, H, n_q]: log Σ_j exp(s_ij) over visible keys; -inf where none is
};

// q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v] -> out [B,H,n_q,d_v], lse [B,H,n_q].
// Tiled with an online softmax; never forms the n_q×n_k matrix. A row that sees no key
// gets out = 0 and lse = -inf.
template <class T>
SoftmaxAttentionResult<T> softmax_attention(TensorView<const T> q, TensorView<const T> k,
                                            TensorView<const T> v,
                                            const AttentionOptions& opts = {});

// Gradients of Σ dout∘out with respect to q, k, v. This overload recomputes out and lse.
template <class T>
AttentionGrads<T> softmax_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                             TensorView<const T> v, TensorView<const T> dout,
                                             const AttentionOptions& opts = {});

// Same, from the forward's saved out and lse (no recomputation of the forward).
template <class T>
AttentionGrads<T> softmax_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                             TensorView<const T> v, TensorView<const T> dout,
                                             TensorView<const T> out, TensorView<const T> lse,
                                             const AttentionOptions& opts = {});

}  // namespace linattn
