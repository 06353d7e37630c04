// favor_attention in float32 with a choice of product arithmetic: the registry's bfloat16 calls
// run it with Products::Bfloat16 on their widened inputs (register.cc; docs/precision.md). The
// public functions are these with Products::Native.
#pragma once

#include <optional>

#include "linattn/core/products.h"
#include "linattn/kernelized.h"

namespace linattn::kernelized {

// What a backward was given of the forward's results (checked there).
template <class T>
struct SavedResults {
  TensorView<const T> out, den, state;
};

// The forward returns den and state too (favor_attention_with_saved's); the backward takes the
// forward's out, den and state as `saved`, or nullopt to run the forward first.
// Products::Bfloat16 refuses the trig kernel (std::invalid_argument naming the function).
KernelizedAttentionResult<float> favor_forward(Products products, TensorView<const float> q, TensorView<const float> k,
                                               TensorView<const float> v, TensorView<const float> projection,
                                               const FavorOptions& opts);
AttentionGrads<float> favor_backward(Products products, TensorView<const float> q, TensorView<const float> k,
                                     TensorView<const float> v, TensorView<const float> projection,
                                     TensorView<const float> dout, const std::optional<SavedResults<float>>& saved,
                                     const FavorOptions& opts);

}  // namespace linattn::kernelized
