// What the reference implementations return: a float64 value and, element by element, a
// worst-case bound on the rounding error of a fast path computing it (see tracked_matrix.h).
#pragma once

#include "linattn/tensor.h"

namespace linattn::reference {
struct Bounded {
  Tensor<double> value, bound;
};
}  // namespace linattn::reference
