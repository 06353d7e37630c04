// Feature maps φ of kernelized attention and of the hybrid's linear part, applied to blocks of rows.
//
// Plain maps (elu+1, relu, focused) give φ(x) directly: bounded by a small multiple of |x|.
// Random-feature maps (FAVOR) give φ in log form, φ_r(x) = s_r(x)·exp(L_r(x)) with s_r = 1 for
// the positive maps: the engine exponentiates L − shift with per-feature shifts chosen from the
// keys it has seen (see engine.cc), so no exponent overflows and no denominator underflows, at
// any input norm where the logits themselves are finite.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "linattn/core/products.h"
#include "linattn/kernelized.h"
#include "linattn/tensor.h"

namespace linattn {

// The largest focus_power of the focused map: (r/2^e)ᵖ < 2ᵖ must fit the wide type it is
// computed in (double for float32, long double for float64).
inline constexpr double kMaxFocusPower = 1000;

enum class FeatureMapKind {
  Elu,              // elu(x) + 1
  Relu,             // max(x, 0)
  Given,            // x itself: q and k are already features (non-negative), given by a map of
                    // the caller's (a learned one, say), which differentiates dq, dk through it
  Focused,          // r = relu(x); ‖r‖·rᵖ/‖rᵖ‖ (focused linear attention)
  FavorPositive,    // exp(ω·x̃ − ‖x̃‖²/2)/√m, x̃ = √scale·x
  FavorHyperbolic,  // exp(−‖x̃‖²/2)/√(2m)·[exp(ω·x̃), exp(−ω·x̃)]
  FavorTrig,        // exp(‖x̃‖²/2)/√m·[sin(ω·x̃), cos(ω·x̃)]
};

// Which side of the attention a row is on. Terms constant over a query row's features cancel
// in out_i = φ(q_i)·Σφ(k)v / φ(q_i)·Σφ(k), so query logits leave them out. QueryWithNorm: a
// query whose −‖x̃‖²/2 does not cancel, because its weights share a normaliser with exact ones
// (the sliding-window hybrid's e^{s_ij}); its logits are the key form.
enum class Side { Query, Key, QueryWithNorm };

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
  // FAVOR maps: φ in log form (logits below); plain maps: φ itself (features below).
  bool log_form() const { return kind_ >= FeatureMapKind::FavorPositive; }
  // Trig: φ = s·exp(L) with s = [sin, cos] not all 1.
  bool has_factor() const { return kind_ == FeatureMapKind::FavorTrig; }
  double focus_power() const { return focus_power_; }

  // ---- plain maps ----
  // phi [n × d] = φ(x) for rows x [n × d].
  void features(const T* x, int64_t n, T* phi) const;
  // dx [n × d] = (∂φ/∂x)ᵀ·dphi; phi: features() of x.
  void features_backward(const T* x, int64_t n, const T* phi, const T* dphi, T* dx) const;

  // ---- FAVOR maps ----
  // L [n × m'] = the log-magnitudes and, for trig, s [n × m'] the factors (s may be null
  // otherwise), up to a constant shared by all rows and features (log √m' is left out):
  //   keys (and QueryWithNorm): positive L = U − h; hyperbolic [U − h, −U − h]; trig L = h,
  //            s = [sin U, cos U]
  //   queries: positive L = U;     hyperbolic [U, −U];         trig L = 0, s = [sin U, cos U]
  // with U = x̃·ωᵀ, x̃ = √scale·x, h = ‖x̃‖²/2. Throws Error if a logit is not finite.
  // products: the arithmetic of U's product (Products::Bfloat16: x and ω are rounded to
  // bfloat16, exactly when they are bfloat16 values, as in a bfloat16 call). name: the argument
  // x is, in errors (default "k" for keys, else "q").
  void logits(const char* fn, const T* x, int64_t n, Side side, T* L, T* s,
              Products products = Products::Native, const char* name = nullptr) const;
  // dx [n × d] from dL = ∂loss/∂L and (trig) ds = ∂loss/∂s; s: logits()' factors (trig).
  // scratch: scratch_size(n) values.
  void logits_backward(const T* x, int64_t n, Side side, const T* dL, const T* s, const T* ds,
                       T* dx, T* scratch, Products products = Products::Native) const;
  int64_t scratch_size(int64_t n) const;

  // For Products::Bfloat16 calls of a float32 FAVOR map: ω rounded and packed once (as B of
  // logits' and logits_backward's products) rather than once per block of rows, which at the
  // causal chunks' 32 rows cost a third of U's product. The same bits. Needs AVX512-BF16.
  void pack_projection();
  bool projection_packed() const { return omega_t_packed_ != nullptr; }

 private:
  // C = alpha·A·op(ω) + beta·C, op(ω) = ωᵀ (transposed) or ω, from the packed copy when there is
  // one for these products.
  void times_projection(Products products, Mat<T> C, Mat<const T> A, bool transposed, T alpha, T beta) const;

  FeatureMapKind kind_ = FeatureMapKind::Elu;
  int64_t d_ = 0, dim_ = 0, m_ = 0;
  double focus_power_ = 3, sqrt_scale_ = 1;
  double omega_norm_max_ = 0;  // max_r ‖ω_r‖: |ω_r·x̃| <= ‖x̃‖·omega_norm_max_
  const T* omega_ = nullptr;   // [m, d]
  // pack_projection()'s ωᵀ and ω, shared by the map's copies (null: pack per product).
  std::shared_ptr<const Bf16PackedB> omega_t_packed_, omega_packed_;
};

class KeyMask;
struct RecurrentOptions;

// The map RecurrentOptions names (RecurrentState, the state operations), its options checked
// (fn in errors): "favor" needs the projection and sets opts.eps to 0; the plain maps refuse
// projection, kernel and scale.
template <class T>
FeatureMap<T> feature_map_from_options(const char* fn, RecurrentOptions& opts, int64_t head_dim,
                                       std::optional<TensorView<const T>> projection);

// With feature_map="given", q and k are features: each value x [B,H,n,m'] must be >= 0, so
// that every attention weight φ(q_i)·φ(k_j) and normaliser is >= 0 (throws Error naming fn and
// `name`, with the first offending position, otherwise). With a mask (keys), only the rows
// below each item's key length: padded keys may hold anything. Does nothing for other maps.
// x is stored as T, or as bfloat16 for a float32 map (a bfloat16 call).
template <class T, class S>
void check_given_features(const char* fn, const char* name, const FeatureMap<T>& fmap, TensorView<const S> x,
                          const KeyMask* mask = nullptr);

// The plain maps by name ("elu", "relu", "focused", "given"): the one list every method's
// feature_map option, parser and error message takes, so a new fixed map is named here alone.
const std::vector<std::string>& plain_feature_map_names();
// Those names as an error message lists them: "elu", "relu", "focused" or "given" (then `also`,
// another choice of the option, last).
std::string plain_feature_map_choices(const char* also = nullptr);
// The fixed maps (all but "given") with their formulas, for an option's help: "elu (elu(x)+1),
// relu (max(x, 0)), focused (...)".
std::string fixed_feature_maps_help();
// The name of a plain map's kind (the inverse of parse_plain_feature_map).
const char* plain_feature_map_name(FeatureMapKind kind);

// plain_feature_map_names()' kinds ("identity", "given"'s spelling before 0.2, too) /
// "positive", "hyperbolic", "trig", with the function name in errors.
FeatureMapKind parse_plain_feature_map(const char* fn, const std::string& name);
FeatureMapKind parse_favor_kernel(const char* fn, const std::string& name);

// A plain map's largest feature for inputs whose largest |value| is x_max, over rows of
// head_dim values (the ranges the kernels refuse inputs by): elu+1 <= x + 1, relu and given
// <= x, focused ‖r‖·rᵖ/‖rᵖ‖ <= ‖r‖ <= √d·x.
double plain_feature_bound(FeatureMapKind kind, double x_max, int64_t head_dim);

}  // namespace linattn
