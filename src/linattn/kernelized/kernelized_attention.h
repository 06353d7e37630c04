// Kernelized (linear) attention and Performer / FAVOR+:
//   out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / (Σ_j φ(q_i)·φ(k_j) + eps)
// over the keys query i sees. O(n) time and memory.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/tensor.h"

namespace linattn {

struct LinearAttentionOptions {
  std::string feature_map = "elu";  // "elu" (elu(x)+1), "relu", "focused"
  // Query i sees keys j <= i (needs n_q == n_k; for decoding use RecurrentState).
  bool causal = false;
  std::optional<std::vector<int64_t>> key_lengths;  // one per batch item; later keys ignored
  double eps = 1e-6;         // added to every denominator (>= 0, finite)
  double focus_power = 3;    // p of the "focused" map (>= 1)
};

struct FavorOptions {
  std::string kernel = "positive";  // "positive" (FAVOR+), "hyperbolic", "trig"
  bool causal = false;              // as above
  std::optional<std::vector<int64_t>> key_lengths;
  std::optional<double> scale;      // approximates softmax(q·kᵀ·scale); default 1/sqrt(d)
};

template <class T>
struct KernelizedGrads {
  Tensor<T> dq, dk, dv;
  Tensor<T> d_dwc_weight;  // [heads, K] when a dwc_weight was given, else empty
};

// q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v] -> out [B,H,n_q,d_v].
// dwc_weight [heads, K]: adds a depthwise convolution of v along the sequence (n_q == n_k):
// out[i] += Σ_t w[h,t]·v[i+t−(K−1)/2] (K odd) or, causal, Σ_t w[h,t]·v[i+t−(K−1)]; v is 0
// outside the sequence and at padded positions.
template <class T>
Tensor<T> linear_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                           const LinearAttentionOptions& opts = {},
                           std::optional<TensorView<const T>> dwc_weight = std::nullopt);

template <class T>
KernelizedGrads<T> linear_attention_backward(
    TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<const T> dout,
    const LinearAttentionOptions& opts = {},
    std::optional<TensorView<const T>> dwc_weight = std::nullopt);

// projection ω [m, d] (see random_features) -> out [B,H,n_q,d_v] ≈ softmax attention.
template <class T>
Tensor<T> favor_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                          TensorView<const T> projection, const FavorOptions& opts = {});

template <class T>
AttentionGrads<T> favor_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                           TensorView<const T> v, TensorView<const T> projection,
                                           TensorView<const T> dout, const FavorOptions& opts = {});

namespace reference {
// Plain float64 loops over the full n_q×n_k matrix of φ(q_i)·φ(k_j), features by their
// unstabilised formulas: the definition the fast paths are tested against.
Tensor<double> linear_attention(TensorView<const double> q, TensorView<const double> k,
                                TensorView<const double> v, const LinearAttentionOptions& opts = {},
                                std::optional<TensorView<const double>> dwc_weight = std::nullopt);
KernelizedGrads<double> linear_attention_backward(
    TensorView<const double> q, TensorView<const double> k, TensorView<const double> v,
    TensorView<const double> dout, const LinearAttentionOptions& opts = {},
    std::optional<TensorView<const double>> dwc_weight = std::nullopt);
Tensor<double> favor_attention(TensorView<const double> q, TensorView<const double> k,
                               TensorView<const double> v, TensorView<const double> projection,
                               const FavorOptions& opts = {});
AttentionGrads<double> favor_attention_backward(TensorView<const double> q,
                                                TensorView<const double> k,
                                                TensorView<const double> v,
                                                TensorView<const double> projection,
                                                TensorView<const double> dout,
                                                const FavorOptions& opts = {});
// A feature map alone on rows x [n, d] (unstabilised): φ [n, m'] and, if jacobian is given,
// ∂φ_r/∂x_c as [n, m', d]. `name`: elu, relu, focused (focus_power) or, with a projection,
// positive, hyperbolic, trig (scale). For estimator tests and error bounds.
Tensor<double> features(TensorView<const double> x, const std::string& name,
                        std::optional<TensorView<const double>> projection = std::nullopt,
                        double scale = 1.0, double focus_power = 3,
                        Tensor<double>* jacobian = nullptr);
}  // namespace reference

}  // namespace linattn
