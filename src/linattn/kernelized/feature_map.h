// Feature maps φ of kernelized attention, applied to blocks of rows.
// Stabilised maps (FAVOR) return φ̃ and a per-row log-scale ls with φ(x) = φ̃(x)·exp(ls(x)),
// so that no exponent overflows; the attention carries ls (for keys) or drops it (for
// queries, where a per-row constant cancels in the ratio).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "linattn/core/memory.h"
#include "linattn/core/tensor.h"

namespace linattn {

enum class FeatureMapKind {
  Elu,              // elu(x) + 1
  Relu,             // max(x, 0)
  Focused,          // r = relu(x); ‖r‖·rᵖ/‖rᵖ‖ (focused linear attention)
  FavorPositive,    // exp(ω·x̃ − ‖x̃‖²/2)/√m, x̃ = √scale·x
  FavorHyperbolic,  // exp(−‖x̃‖²/2)/√(2m)·[exp(ω·x̃), exp(−ω·x̃)]
  FavorTrig,        // exp(‖x̃‖²/2)/√m·[sin(ω·x̃), cos(ω·x̃)]
};

template <class T>
class FeatureMap {
 public:
  // The factories check their arguments and name `fn`, the public function, in errors.
  // elu, relu, focused (focus_power finite and >= 1).
  static FeatureMap plain(const char* fn, FeatureMapKind kind, int64_t head_dim,
                          double focus_power = 3);
  // FAVOR maps with projection ω [m >= 1, head_dim], finite (kept by pointer: must outlive the
  // map); scale finite and > 0, default 1/sqrt(head_dim).
  static FeatureMap favor(const char* fn, FeatureMapKind kind, TensorView<const T> projection,
                          int64_t head_dim, std::optional<double> scale);

  FeatureMapKind kind() const { return kind_; }
  int64_t input_dim() const { return d_; }
  int64_t dim() const { return dim_; }  // m' = d (plain), m (positive), 2m (hyperbolic, trig)
  bool stabilized() const { return kind_ >= FeatureMapKind::FavorPositive; }

  // phi [n × dim()] = φ̃(x) for rows x [n × d] (row stride d); log_scale [n] (stabilised maps
  // only; may be null to drop it).
  void forward(const T* x, int64_t n, T* phi, T* log_scale) const;
  // dx [n × d] = (∂φ̃/∂x)ᵀ·dphi with the log-scale held constant (it cancels in attention,
  // so this is the exact gradient of the attention). phi: forward()'s output for x.
  // scratch: scratch_size(n) values.
  void backward(const T* x, int64_t n, const T* phi, const T* dphi, T* dx, T* scratch) const;
  int64_t scratch_size(int64_t n) const;  // of backward()

 private:
  FeatureMapKind kind_ = FeatureMapKind::Elu;
  int64_t d_ = 0, dim_ = 0, m_ = 0;
  double focus_power_ = 3, sqrt_scale_ = 1;
  const T* omega_ = nullptr;  // [m, d]
};

// "elu", "relu", "focused" / "positive", "hyperbolic", "trig", with the function name in errors.
FeatureMapKind parse_plain_feature_map(const char* fn, const std::string& name);
FeatureMapKind parse_favor_kernel(const char* fn, const std::string& name);

}  // namespace linattn
