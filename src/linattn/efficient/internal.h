// Argument checks shared by the Efficient Attention fast path and its reference.
#pragma once

#include "linattn/efficient/efficient_attention.h"

namespace linattn::efficient {

using Setup = NonCausalArgs;

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 const EfficientAttentionOptions& opts);

}  // namespace linattn::efficient
