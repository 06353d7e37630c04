// A registry call's arguments as efficient_attention's typed options (used by register.cc and
// by the reference's registration).
#pragma once

#include "linattn/core/method_support.h"
#include "linattn/efficient.h"

namespace linattn::efficient {

template <class T>
EfficientAttentionOptions options_from(const MethodArgs<T>& a) {
  EfficientAttentionOptions o;
  registry_support::ArgReader<T>(method("efficient"), a).read_common(o);
  return o;
}

}  // namespace linattn::efficient
