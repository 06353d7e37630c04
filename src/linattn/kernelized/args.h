// Registry calls' arguments as linear_attention's and favor_attention's typed options and
// tensors (used by register.cc and by the references' registration).
#pragma once

#include "linattn/core/method_support.h"
#include "linattn/kernelized.h"

namespace linattn::kernelized {

template <class T>
struct LinearCall {
  LinearAttentionOptions opts;
  std::optional<TensorView<const T>> conv_weight;
};

template <class T>
LinearCall<T> linear_call(const MethodArgs<T>& a) {
  const registry_support::ArgReader<T> r(method("linear"), a);
  LinearCall<T> c;
  r.read_common(c.opts);
  r.read("feature_map", c.opts.feature_map);
  r.read("eps", c.opts.eps);
  r.read("focus_power", c.opts.focus_power);
  c.conv_weight = r.tensor("conv_weight");
  return c;
}

template <class T>
struct FavorCall {
  FavorOptions opts;
  TensorView<const T> projection;
};

template <class T>
FavorCall<T> favor_call(const MethodArgs<T>& a) {
  const registry_support::ArgReader<T> r(method("favor"), a);
  FavorCall<T> c;
  r.read_common(c.opts);
  r.read("kernel", c.opts.kernel);
  c.projection = r.required_tensor("projection");
  return c;
}

}  // namespace linattn::kernelized
