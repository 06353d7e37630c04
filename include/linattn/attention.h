// What every attention method takes besides its tensors, and what every backward returns.
// Each method's options struct extends AttentionOptions with its own fields.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "linattn/tensor.h"

namespace linattn {

struct AttentionOptions {
  // Query i sees keys j <= i + (n_k - n_q): aligned bottom-right, so the last query sees all.
  // Methods without a causal form (Nyström, Linformer, Efficient Attention) refuse true.
  bool causal = false;
  // Logit scale; default 1/sqrt(head_dim). Must be finite and representable in the dtype.
  // Methods whose maps take no scale (linear_attention) refuse a value.
  std::optional<double> scale;
  // One length per batch item; keys at positions >= key_lengths[b] are ignored (removed from
  // every normaliser; never read, so they may hold anything).
  std::optional<std::vector<int64_t>> key_lengths;
};

// The sizes of one call: q [batch, heads, n_q, head_dim], k [batch, heads, n_k, head_dim],
// v [batch, heads, n_k, value_dim].
struct AttentionShape {
  int64_t batch = 0, heads = 0, n_q = 0, n_k = 0, head_dim = 0, value_dim = 0;
  int64_t bh() const { return batch * heads; }
};

// Gradients of Σ dout∘out with respect to every input that has one.
template <class T>
struct AttentionGrads {
  Tensor<T> dq, dk, dv;
  // The method's learned inputs, in the order it takes them, by name: linear_attention
  // and nystrom_attention "conv_weight", linformer_attention "e" and "f". Empty for a
  // call without any.
  std::vector<std::pair<std::string, Tensor<T>>> params;

  const Tensor<T>& param(std::string_view name) const {
    for (const auto& [n, t] : params)
      if (n == name) return t;
    throw Error("AttentionGrads: no gradient named \"" + std::string(name) + "\"");
  }
  Tensor<T>& param(std::string_view name) {
    return const_cast<Tensor<T>&>(static_cast<const AttentionGrads&>(*this).param(name));
  }
};

}  // namespace linattn
