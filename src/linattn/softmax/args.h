// A registry call's arguments as softmax_attention's typed options (used by register.cc and
// by the reference's registration).
#pragma once

#include "linattn/core/method_support.h"
#include "linattn/softmax.h"

namespace linattn::softmax_detail {

template <class T>
AttentionOptions options_from(const MethodArgs<T>& a) {
  AttentionOptions o;
  registry_support::ArgReader<T>(method("softmax"), a).read_common(o);
  return o;
}

}  // namespace linattn::softmax_detail
