// A registry call's arguments as linformer_attention's typed options and projections (used by
// register.cc and by the reference's registration).
#pragma once

#include "linattn/core/method_support.h"
#include "linattn/linformer.h"

namespace linattn::linformer {

template <class T>
struct Call {
  LinformerOptions opts;
  TensorView<const T> e, f;
};

template <class T>
Call<T> call_from(const MethodArgs<T>& a) {
  const registry_support::ArgReader<T> r(method("linformer"), a);
  Call<T> c;
  r.read_common(c.opts);
  c.e = r.required_tensor("e");
  c.f = r.required_tensor("f");
  return c;
}

}  // namespace linattn::linformer
