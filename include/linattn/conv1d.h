// The short causal depthwise convolution in front of the gated-delta-rule and KDA layers
// (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi Linear; the `causal_conv1d` package's
// causal_conv1d_fn / causal_conv1d_update), state in and state out (docs/methods/delta.md):
//   z[b,c,t] = bias[c] + Σ_{j<W} weight[c,j] · x̃[b,c,t+j],   out = silu(z) or z
// where x̃ is x [B, C, T] with the W−1 positions before it in front: the initial state
// [B, C, W−1] (the last inputs of the previous call), zeros without one. The final state is the
// last W−1 positions of x̃ ([B, C, W−1]), so two calls over a split equal one call. Layout
// [batch, channels, seq], as transformers passes it.
#pragma once

#include "linattn/tensor.h"

namespace linattn {

struct CausalConv1dOptions {
  bool silu = true;  // out = z·sigmoid(z); false: out = z
};

template <class T>
struct CausalConv1dResult {
  Tensor<T> out;    // [B, C, T]
  Tensor<T> state;  // [B, C, W−1]
};

template <class T>
struct CausalConv1dGrads {
  Tensor<T> dx;              // [B, C, T]
  Tensor<T> dweight;         // [C, W]
  Tensor<T> dbias;           // [C] (empty when no bias was given)
  Tensor<T> dinitial_state;  // [B, C, W−1] (zeros' gradient when no initial state was given)
};

// x [B, C, T], weight [C, W] (W >= 1), bias empty or [C], initial_state empty or [B, C, W−1],
// all finite; error naming the argument otherwise.
template <class T>
CausalConv1dResult<T> causal_conv1d(TensorView<const T> x, TensorView<const T> weight, TensorView<const T> bias,
                                    TensorView<const T> initial_state, const CausalConv1dOptions& opts = {});

// The gradients for dout [B, C, T] and (optional, data null for none) dstate [B, C, W−1].
template <class T>
CausalConv1dGrads<T> causal_conv1d_backward(TensorView<const T> x, TensorView<const T> weight,
                                            TensorView<const T> bias, TensorView<const T> initial_state,
                                            TensorView<const T> dout, TensorView<const T> dstate,
                                            const CausalConv1dOptions& opts = {});

}  // namespace linattn
