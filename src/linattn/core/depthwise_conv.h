// Depthwise convolution of V along the sequence, added to an attention output: the local term
// some methods add (a learned [heads, K] weight, with its gradient).
//   out[b,h,i] += Σ_t w[h,t]·v[b,h,i+t−off],  off = (K−1)/2 (centred) or K−1 (causal),
// with v taken as 0 outside the sequence and at padded positions (>= key_length(b)).
#pragma once

#include "linattn/core/attention_args.h"

namespace linattn {

// w must be [heads, K], finite, K odd unless causal, and n_q == n_k. `name` is the argument's
// name in the caller's API ("conv_weight").
template <class T>
void check_depthwise_conv(const char* fn, const char* name, const AttentionDims& d, bool causal,
                          TensorView<const T> w);

// out [B,H,n,d_v] += conv(v).
template <class T>
void depthwise_conv_forward(TensorView<const T> v, TensorView<const T> w, const AttentionDims& d,
                            const KeyMask& mask, bool causal, T* out);

// Undoes out += conv(v): dv [B,H,n,d_v] += convᵀ(dout) at unpadded positions, dw [heads,K] =
// Σ_{b,i} dout_i·v_{i+t−off} (overwritten).
template <class T>
void depthwise_conv_backward(TensorView<const T> v, TensorView<const T> w, const T* dout,
                             const AttentionDims& d, const KeyMask& mask, bool causal, T* dv, T* dw);

}  // namespace linattn
