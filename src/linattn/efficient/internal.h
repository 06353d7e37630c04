// Argument checks shared by the Efficient Attention fast path and its reference.
#pragma once

#include "linattn/core/attention_args.h"
#include "linattn/efficient.h"

namespace linattn::efficient {

inline constexpr int64_t kRowBlock = 256;  // query rows per block

using Setup = NonCausalArgs;

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 const EfficientAttentionOptions& opts);

}  // namespace linattn::efficient
