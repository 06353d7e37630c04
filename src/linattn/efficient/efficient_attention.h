// Efficient Attention (Shen et al., 2021): softmax over features for queries, over positions
// for keys,  out = softmax_d(Q·s) · (softmax_n(K·s)ᵀ V),  s default 1/sqrt(head_dim).
// O(n·d·d_v) time, O(n·d) memory. Never causal: the key softmax normalises over all positions.
#pragma once

#include <optional>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/bounded.h"
#include "linattn/core/tensor.h"

namespace linattn {

struct EfficientAttentionOptions {
  std::optional<std::vector<int64_t>> key_lengths;  // padded keys leave the softmax over positions
  std::optional<double> scale;                      // default 1/sqrt(head_dim)
  bool causal = false;  // true is an error: there is no causal Efficient Attention
};

// q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v] -> out [B,H,n_q,d_v].
template <class T>
Tensor<T> efficient_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                              const EfficientAttentionOptions& opts = {});

template <class T>
AttentionGrads<T> efficient_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                               TensorView<const T> v, TensorView<const T> dout,
                                               const EfficientAttentionOptions& opts = {});

namespace reference {
// Float64 loops with rounding bounds at unit roundoff u (see tracked_matrix.h).
Bounded efficient_attention(TensorView<const double> q, TensorView<const double> k,
                            TensorView<const double> v, const EfficientAttentionOptions& opts,
                            double u = 0);
// dq, dk, dv.
std::vector<Bounded> efficient_attention_backward(TensorView<const double> q,
                                                  TensorView<const double> k,
                                                  TensorView<const double> v,
                                                  TensorView<const double> dout,
                                                  const EfficientAttentionOptions& opts, double u = 0);
}  // namespace reference

}  // namespace linattn
