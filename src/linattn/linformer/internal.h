// Argument checks shared by the Linformer fast path and its reference.
#pragma once

#include "linattn/core/attention_args.h"
#include "linattn/linformer.h"

namespace linattn::linformer {

inline constexpr int64_t kRowBlock = 256;  // query rows per softmax(Q K'ᵀ) block
inline constexpr int64_t kColBlock = 256;  // columns of dE, dF per task of the backward

struct Setup : NonCausalArgs {
  int64_t s_proj = 0, n_max = 0;
  bool per_head = false;
  // Projection matrix of head h: rows of n_max values.
  int64_t offset(int64_t h) const { return per_head ? h * s_proj * n_max : 0; }
};

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 TensorView<const T> e, TensorView<const T> f, const LinformerOptions& opts);

}  // namespace linattn::linformer
