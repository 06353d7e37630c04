// The float64 reference of kernelized attention: plain loops, the definition the fast paths are
// tested against (internal: part of the linattn_reference library).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "linattn/kernelized.h"
#include "linattn/core/bounded.h"

namespace linattn {

namespace reference {
// Plain float64 loops over the full n_q×n_k matrix of φ(q_i)·φ(k_j), features by their
// unstabilised formulas: the definition the fast paths are tested against.
Tensor<double> linear_attention(TensorView<const double> q, TensorView<const double> k,
                                TensorView<const double> v, const LinearAttentionOptions& opts = {},
                                std::optional<TensorView<const double>> conv_weight = std::nullopt);
AttentionGrads<double> linear_attention_backward(
    TensorView<const double> q, TensorView<const double> k, TensorView<const double> v,
    TensorView<const double> dout, const LinearAttentionOptions& opts = {},
    std::optional<TensorView<const double>> conv_weight = std::nullopt);
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
// Hedgehog's map by its textbook (unshifted) softmaxes: x [B,H,n,d], weight [H,d,f], bias [H,f]
// -> [B,H,n,2f]. Its gradients are tested against central differences of this.
Tensor<double> hedgehog_features(TensorView<const double> x, TensorView<const double> weight,
                                 TensorView<const double> bias);
}  // namespace reference

}  // namespace linattn
