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

// hybrid_prefill's state from its definition (include/linattn/hybrid.h), with the features
// given (key_features [B, H, n, m'], H a multiple of k's H_kv); valid and log_decay may be empty.
// magnitude = true sums |φ|·|v| weights instead: the scale of each sum, for rounding bounds.
struct HybridPrefillState {
  Tensor<double> sums, normaliser, exact_keys, exact_values;
  Tensor<bool> exact_valid;
  Tensor<int64_t> counts;
};
HybridPrefillState hybrid_prefill(TensorView<const double> k, TensorView<const double> v,
                                  TensorView<const double> key_features, TensorView<const bool> valid,
                                  TensorView<const double> log_decay, int64_t window, int64_t sinks,
                                  bool magnitude = false);

}  // namespace linattn::reference
