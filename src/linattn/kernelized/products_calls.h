// The registry's bfloat16 calls of linear_attention and favor_attention (register.cc;
// docs/precision.md), and both in float32 with a choice of product arithmetic (the widened
// calls those fall back to).
#pragma once

#include <optional>

#include "linattn/core/products.h"
#include "linattn/kernelized.h"
#include "linattn/low_precision.h"

namespace linattn::kernelized {

// What a backward was given of the forward's results (checked there).
template <class T>
struct SavedResults {
  TensorView<const T> out, den, state;
};

// What a bfloat16 backward was given: den and state, and out either widened (widened.out) or as
// the forward returned it (out_as_returned, read a block at a time; widened.out then empty).
struct Bf16SavedResults {
  SavedResults<float> widened;
  std::optional<TensorView<const bfloat16>> out_as_returned;
};

// The forward returns den and state too (favor_attention_with_saved's); the backward takes the
// forward's out, den and state as `saved`, or nullopt to run the forward first.
// Products::Bfloat16 refuses the trig kernel (std::invalid_argument naming the function).
KernelizedAttentionResult<float> linear_forward(Products products, TensorView<const float> q, TensorView<const float> k,
                                                TensorView<const float> v, const LinearAttentionOptions& opts,
                                                std::optional<TensorView<const float>> conv_weight);
AttentionGrads<float> linear_backward(Products products, TensorView<const float> q, TensorView<const float> k,
                                      TensorView<const float> v, TensorView<const float> dout,
                                      const std::optional<SavedResults<float>>& saved, const LinearAttentionOptions& opts,
                                      std::optional<TensorView<const float>> conv_weight);
KernelizedAttentionResult<float> favor_forward(Products products, TensorView<const float> q, TensorView<const float> k,
                                               TensorView<const float> v, TensorView<const float> projection,
                                               const FavorOptions& opts);
AttentionGrads<float> favor_backward(Products products, TensorView<const float> q, TensorView<const float> k,
                                     TensorView<const float> v, TensorView<const float> projection,
                                     TensorView<const float> dout, const std::optional<SavedResults<float>>& saved,
                                     const FavorOptions& opts);

// bfloat16 calls on the float32 engine reading and writing bfloat16 a block at a time
// (engine.h, Problem<float, bfloat16>): q, k, v and dout are checked as they are and never
// widened whole; sums, den and state are float32, the output and gradients rounded once, as the
// widened float32 call would give them. nullopt where v or dout exceeds 2^64, which the float32
// code rescales first (ValueScale): the caller widens then (register.cc also widens linear
// attention with a conv_weight, whose convolution reads v in float32). products: those of every
// matrix product (Products::Bfloat16 refuses favor's trig kernel).
struct Bf16Forward {
  Tensor<bfloat16> out;     // [B,H,n_q,d_v]
  Tensor<float> den, state;  // KernelizedAttentionResult's
};
std::optional<Bf16Forward> linear_forward_bf16(Products products, TensorView<const bfloat16> q,
                                               TensorView<const bfloat16> k, TensorView<const bfloat16> v,
                                               const LinearAttentionOptions& opts);
std::optional<AttentionGrads<bfloat16>> linear_backward_bf16(Products products, TensorView<const bfloat16> q,
                                                             TensorView<const bfloat16> k, TensorView<const bfloat16> v,
                                                             TensorView<const bfloat16> dout,
                                                             const std::optional<Bf16SavedResults>& saved,
                                                             const LinearAttentionOptions& opts);
std::optional<Bf16Forward> favor_forward_bf16(Products products, TensorView<const bfloat16> q, TensorView<const bfloat16> k,
                                              TensorView<const bfloat16> v, TensorView<const float> projection,
                                              const FavorOptions& opts);
std::optional<AttentionGrads<bfloat16>> favor_backward_bf16(Products products, TensorView<const bfloat16> q,
                                                            TensorView<const bfloat16> k, TensorView<const bfloat16> v,
                                                            TensorView<const float> projection,
                                                            TensorView<const bfloat16> dout,
                                                            const std::optional<Bf16SavedResults>& saved,
                                                            const FavorOptions& opts);

}  // namespace linattn::kernelized
