// Nyströmformer (Xiong et al., 2021): softmax attention through m landmarks,
//   out = softmax(Q K̃ᵀ·s) · pinv(softmax(Q̃ K̃ᵀ·s)) · softmax(Q̃ Kᵀ·s) V  (+ conv of V),
// Q̃, K̃ the segment means of the queries and keys. O(n·m·d) time, O(n·m) memory per head.
// Self-attention only (n_q == n_k) and never causal: landmarks pool over future positions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "linattn/attention.h"
#include "linattn/tensor.h"

namespace linattn {

// causal = true is an error: there is no causal Nyström attention.
struct NystromOptions : AttentionOptions {
  // Landmarks m (>= 1). A sequence of n_b valid positions uses min(m, n_b), so with m >= n_b
  // every position is its own landmark.
  int64_t num_landmarks = 64;
  int64_t pinv_iterations = 6;     // Newton–Schulz-type steps of pinv="iterative" (>= 0)
  std::string pinv = "iterative";  // "iterative" or "exact" (SVD by LAPACK)
};

// q, k [B,H,n,d], v [B,H,n,d_v] -> out [B,H,n,d_v].
// conv_weight [heads, K], K odd: out[i] += Σ_t w[h,t]·v[i+t−(K−1)/2], v zero outside the
// sequence and at padded positions.
template <class T>
Tensor<T> nystrom_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                            const NystromOptions& opts = {},
                            std::optional<TensorView<const T>> conv_weight = std::nullopt);

// Gradients of Σ out∘dout through the pooling, all three softmaxes, the pseudo-inverse (the
// iterations as computed, or the SVD pseudo-inverse's derivative) and the convolution:
// dq, dk, dv and, with a conv_weight, params {"conv_weight"}.
template <class T>
AttentionGrads<T> nystrom_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                           TensorView<const T> v, TensorView<const T> dout,
                                           const NystromOptions& opts = {},
                                           std::optional<TensorView<const T>> conv_weight = std::nullopt);

// Landmark j of a sequence of n positions and m landmarks (adaptive average pooling) averages
// positions [segment_begin(j), segment_end(j)): floor(j·n/m) .. ceil((j+1)·n/m) − 1.
inline int64_t segment_begin(int64_t j, int64_t n, int64_t m) { return j * n / m; }
inline int64_t segment_end(int64_t j, int64_t n, int64_t m) { return ((j + 1) * n + m - 1) / m; }

}  // namespace linattn
