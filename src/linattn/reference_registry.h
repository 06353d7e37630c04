// The float64 reference of every registered method, by name: plain loops over the full score
// matrices, the definitions the fast paths are tested against (linattn_reference library; the
// tests and the accuracy study use it). Each method folder's reference.cc registers its own,
// through the same list as the methods (methods.def).
#pragma once

#include <functional>
#include <string_view>

#include "linattn/registry.h"

namespace linattn::reference {

struct ReferenceInfo {
  std::function<Tensor<double>(const MethodArgs<double>&)> forward;
  std::function<AttentionGrads<double>(const MethodArgs<double>&, TensorView<const double> dout)> backward;
  // Whether row i of the output depends on row i of q alone (all but Nyström, whose landmarks
  // pool every query, and the hybrid, whose window depends on the row's position): then a
  // caller may evaluate sampled rows as one-row problems.
  bool rows_independent = true;
};

const ReferenceInfo& reference_of(std::string_view method_name);

}  // namespace linattn::reference
