// A registry call's arguments as nystrom_attention's typed options (used by register.cc and by
// the reference's registration).
#pragma once

#include "linattn/core/method_support.h"
#include "linattn/nystrom.h"

namespace linattn::nystrom {

template <class T>
struct Call {
  NystromOptions opts;
  std::optional<TensorView<const T>> conv_weight;
};

template <class T>
Call<T> call_from(const MethodArgs<T>& a) {
  const registry_support::ArgReader<T> r(method("nystrom"), a);
  Call<T> c;
  r.read_common(c.opts);
  r.read("num_landmarks", c.opts.num_landmarks);
  r.read("pinv_iterations", c.opts.pinv_iterations);
  r.read("pinv", c.opts.pinv);
  c.conv_weight = r.tensor("conv_weight");
  return c;
}

}  // namespace linattn::nystrom
