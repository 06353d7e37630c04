// The float64 reference of softmax attention: plain loops, the definition the fast paths are
// tested against (internal: part of the linattn_reference library).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "linattn/softmax.h"
#include "linattn/core/bounded.h"

namespace linattn {

namespace reference {
// Plain float64 loops over the full score matrix: the definition the fast path is tested
// against. O(n_q·n_k) memory per (b, h).
SoftmaxAttentionResult<double> softmax_attention(TensorView<const double> q,
                                                 TensorView<const double> k,
                                                 TensorView<const double> v,
                                                 const AttentionOptions& opts = {});
AttentionGrads<double> softmax_attention_backward(TensorView<const double> q,
                                                  TensorView<const double> k,
                                                  TensorView<const double> v,
                                                  TensorView<const double> dout,
                                                  const AttentionOptions& opts = {});
}  // namespace reference

}  // namespace linattn
