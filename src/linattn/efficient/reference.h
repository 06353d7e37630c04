// The float64 reference of efficient attention: plain loops, the definition the fast paths are
// tested against (internal: part of the linattn_reference library).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "linattn/efficient.h"
#include "linattn/core/bounded.h"

namespace linattn {

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
