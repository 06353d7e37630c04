// The float64 reference of linformer attention: plain loops, the definition the fast paths are
// tested against (internal: part of the linattn_reference library).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "linattn/linformer.h"
#include "linattn/core/bounded.h"

namespace linattn {

namespace reference {
// Float64 loops with rounding bounds at unit roundoff u (see tracked_matrix.h).
Bounded linformer_attention(TensorView<const double> q, TensorView<const double> k,
                            TensorView<const double> v, TensorView<const double> e,
                            TensorView<const double> f, const LinformerOptions& opts, double u = 0);
// dq, dk, dv, de, df.
std::vector<Bounded> linformer_attention_backward(TensorView<const double> q,
                                                  TensorView<const double> k,
                                                  TensorView<const double> v,
                                                  TensorView<const double> e,
                                                  TensorView<const double> f,
                                                  TensorView<const double> dout,
                                                  const LinformerOptions& opts, double u = 0);
}  // namespace reference

}  // namespace linattn
