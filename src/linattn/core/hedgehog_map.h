// Hedgehog's learned feature map (Zhang et al., ICLR 2024) of one row, given its logits
// u = x·W_h + b_h [f]: φ = [softmax(u), softmax(−u)] [2f], and the backward to ∂u. The one
// formula: hedgehog_features (kernelized/hedgehog.cc, over whole tensors with BLAS for x·W: its
// hedgehog_block), hybrid_prefill (hedgehog_block) and hybrid_decode_step (one row per head and
// token) call these; the float64 reference is
// reference::hedgehog_features.
#pragma once

#include <algorithm>
#include <cstdint>

#include <optional>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/simd.h"

namespace linattn {

// The checks of one map's weight [H, d, f] (f >= 1; or exactly f when given) and bias [H, f],
// both finite: an Error naming fn and the argument otherwise. Returns f.
template <class T>
int64_t check_hedgehog_map(const char* fn, const char* weight_name, const char* bias_name, TensorView<const T> weight,
                           TensorView<const T> bias, int64_t H, int64_t d, std::optional<int64_t> f = std::nullopt) {
  if (f) {
    check_shape(fn, weight_name, weight, {H, d, *f});
  } else {
    require(weight.rank() == 3 && weight.dim(0) == H && weight.dim(1) == d && weight.dim(2) >= 1, fn, ": ",
            weight_name, " has shape ", shape_string(weight.shape), "; expected [heads = ", H, ", head_dim = ", d,
            ", feature_dim >= 1]");
    f = weight.dim(2);
  }
  check_shape(fn, bias_name, bias, {H, *f});
  check_finite(fn, weight_name, weight);
  check_finite(fn, bias_name, bias);
  return *f;
}

// phi[0, f) = softmax(u), phi[f, 2f) = softmax(−u); phi may hold u already (phi == u). Each half
// is shifted by its own maximum, so any finite logit is safe and each half sums to 1.
template <class T>
void hedgehog_from_logits(const T* u, int64_t f, T* phi) {
  if (phi != u) std::copy(u, u + f, phi);
  for (int64_t j = 0; j < f; ++j) phi[f + j] = -phi[j];
  simd::softmax_rows(phi, 2, static_cast<size_t>(f), static_cast<size_t>(f));
}

// du = p⊙(dp − p·dp) − r⊙(dr − r·dr) for φ = [p, r] and dphi = [dp, dr]: the softmax's
// Jacobian, the second half's through −u. scratch: f values.
template <class T>
void hedgehog_logits_backward(const T* phi, const T* dphi, int64_t f, T* du, T* scratch) {
  const auto n = static_cast<size_t>(f);
  simd::softmax_grad(du, phi, dphi, n, simd::dot(phi, dphi, n));
  simd::softmax_grad(scratch, phi + f, dphi + f, n, simd::dot(phi + f, dphi + f, n));
  for (int64_t j = 0; j < f; ++j) du[j] -= scratch[j];
}

// One row's map from x [d]: u = x·W + b (W [d, f] row-major, b [f]), then φ [2f].
template <class T>
void hedgehog_row(const T* x, const T* W, const T* b, int64_t d, int64_t f, T* phi) {
  std::copy(b, b + f, phi);
  for (int64_t i = 0; i < d; ++i) {
    const T a = x[i];
    const T* w = W + i * f;
    for (int64_t j = 0; j < f; ++j) phi[j] += a * w[j];
  }
  hedgehog_from_logits(phi, f, phi);
}

// φ of a block of rows x [rows × d] into phi [rows × 2f] (W [d, f], b [f]): U = x·W into each
// row's first half by one BLAS product, then each row's map in place (kernelized/hedgehog.cc:
// hedgehog_features and its backward, and hybrid_prefill's key map, run it).
template <class T>
void hedgehog_block(const T* x, const T* W, const T* b, int64_t rows, int64_t d, int64_t f, T* phi);

}  // namespace linattn
