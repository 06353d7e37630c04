// The float64 reference of the sliding-window + linear hybrid: plain loops over every (query,
// key) pair, the definition the fast path is tested against (internal: linattn_reference).
#pragma once

#include "linattn/hybrid.h"

namespace linattn::reference {

// magnitude = true computes the same expressions with every input and intermediate replaced by
// its absolute value and every difference by a sum: the scale of each result, from which the
// tests derive their rounding bounds (first-order error <= ε·magnitude).
Tensor<double> hybrid_attention(TensorView<const double> q, TensorView<const double> k,
                                TensorView<const double> v, const HybridInputs<double>& in,
                                const HybridAttentionOptions& opts, bool magnitude = false);
AttentionGrads<double> hybrid_attention_backward(TensorView<const double> q, TensorView<const double> k,
                                                 TensorView<const double> v, TensorView<const double> dout,
                                                 const HybridInputs<double>& in,
                                                 const HybridAttentionOptions& opts, bool magnitude = false);

}  // namespace linattn::reference
