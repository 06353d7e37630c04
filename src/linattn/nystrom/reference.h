// The float64 reference of nystrom attention: plain loops, the definition the fast paths are
// tested against (internal: part of the linattn_reference library).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "linattn/nystrom.h"
#include "linattn/core/bounded.h"

namespace linattn {

namespace reference {
struct Arith;
struct Tracked;
// The iterative pseudo-inverse one step at a time (tracked_matrix.h): V₀ = Aᵀ/(‖A‖₁‖A‖∞), and
// V ↦ ¼·V(13I − AV(15I − AV(7I − AV))), each with the rounding bound of that step alone when its
// inputs carry no error. Lets a test check every float32 step of the fast path against its
// own derived bound.
Tracked pinv_initial_iterate(const Arith& a, const Tracked& A);
Tracked pinv_iteration(const Arith& a, const Tracked& A, const Tracked& V);

// Float64 loops (tracked_matrix.h) in the association the fast path uses. The result's bound
// is, per element, the worst-case rounding error of a fast path at unit roundoff u (0: none).
// The exact pseudo-inverse is computed here by Gauss–Jordan inversion (an independent method:
// A is square and, where the test applies, invertible).
Bounded nystrom_attention(TensorView<const double> q, TensorView<const double> k,
                          TensorView<const double> v, const NystromOptions& opts,
                          std::optional<TensorView<const double>> conv_weight, double u = 0);
// Values and bounds of dq, dk, dv (and d_conv_weight when given), in that order.
std::vector<Bounded> nystrom_attention_backward(TensorView<const double> q,
                                                TensorView<const double> k,
                                                TensorView<const double> v,
                                                TensorView<const double> dout,
                                                const NystromOptions& opts,
                                                std::optional<TensorView<const double>> conv_weight,
                                                double u = 0);
}  // namespace reference

}  // namespace linattn
