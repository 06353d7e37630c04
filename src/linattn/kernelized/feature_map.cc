#include "linattn/kernelized/feature_map.h"

#include <cmath>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/simd.h"

namespace linattn {

FeatureMapKind parse_plain_feature_map(const char* fn, const std::string& name) {
  if (name == "elu") return FeatureMapKind::Elu;
  if (name == "relu") return FeatureMapKind::Relu;
  if (name == "focused") return FeatureMapKind::Focused;
  fail(fn, ": feature_map must be \"elu\", \"relu\" or \"focused\"; got \"", name, "\"");
}

FeatureMapKind parse_favor_kernel(const char* fn, const std::string& name) {
  if (name == "positive") return FeatureMapKind::FavorPositive;
  if (name == "hyperbolic") return FeatureMapKind::FavorHyperbolic;
  if (name == "trig") return FeatureMapKind::FavorTrig;
  fail(fn, ": kernel must be \"positive\", \"hyperbolic\" or \"trig\"; got \"", name, "\"");
}

template <class T>
FeatureMap<T> FeatureMap<T>::plain(const char* fn, FeatureMapKind kind, int64_t head_dim,
                                   double focus_power) {
  require(kind <= FeatureMapKind::Focused, "FeatureMap::plain: not a plain feature map");
  require(std::isfinite(focus_power) && focus_power >= 1, fn,
          ": focus_power must be a finite number >= 1, got ", focus_power);
  FeatureMap f;
  f.kind_ = kind;
  f.d_ = f.dim_ = head_dim;
  f.focus_power_ = focus_power;
  return f;
}

template <class T>
FeatureMap<T> FeatureMap<T>::favor(const char* fn, FeatureMapKind kind,
                                   TensorView<const T> projection, int64_t head_dim,
                                   std::optional<double> scale_opt) {
  require(kind >= FeatureMapKind::FavorPositive, "FeatureMap::favor: not a FAVOR kernel");
  require(projection.rank() == 2 && projection.dim(0) >= 1 && projection.dim(1) == head_dim, fn,
          ": projection has shape ", shape_string(projection.shape),
          "; expected [num_features >= 1, ", head_dim, "] (head_dim of q)");
  require(simd::all_finite(projection.data, static_cast<size_t>(projection.size())), fn,
          ": projection has a non-finite value");
  AttentionOptions scale_only;
  scale_only.scale = scale_opt;
  const double scale = resolve_scale(fn, scale_only, head_dim);  // finite, or the default
  require(scale > 0, fn, ": scale must be > 0 for random features, got ", scale);
  FeatureMap f;
  f.kind_ = kind;
  f.m_ = projection.dim(0);
  f.d_ = projection.dim(1);
  f.dim_ = kind == FeatureMapKind::FavorPositive ? f.m_ : 2 * f.m_;
  f.omega_ = projection.data;
  f.sqrt_scale_ = std::sqrt(scale);
  return f;
}

template <class T>
int64_t FeatureMap<T>::scratch_size(int64_t n) const {
  return stabilized() ? n * m_ : 0;  // the backward's ω coefficients
}

template <class T>
void FeatureMap<T>::forward(const T* x, int64_t n, T* phi, T* log_scale) const {
  const int64_t d = d_;
  switch (kind_) {
    case FeatureMapKind::Elu:
      simd::elu_plus_one(x, phi, static_cast<size_t>(n * d));
      return;
    case FeatureMapKind::Relu:
      for (int64_t i = 0; i < n * d; ++i) phi[i] = x[i] > 0 ? x[i] : T(0);
      return;
    case FeatureMapKind::Focused: {
      const T p = static_cast<T>(focus_power_);
      for (int64_t i = 0; i < n; ++i) {
        const T* xr = x + i * d;
        T* f = phi + i * d;
        T r2 = 0, a2 = 0;
        for (int64_t c = 0; c < d; ++c) {
          const T r = xr[c] > 0 ? xr[c] : T(0);
          f[c] = r > 0 ? std::pow(r, p) : T(0);
          r2 += r * r;
          a2 += f[c] * f[c];
        }
        const T factor = a2 > 0 ? std::sqrt(r2) / std::sqrt(a2) : T(0);
        for (int64_t c = 0; c < d; ++c) f[c] *= factor;
      }
      return;
    }
    default: break;
  }
  // FAVOR: U = x̃·ωᵀ with x̃ = √scale·x, written straight into the feature rows (first m
  // columns); then per row the map and its log-scale, in place.
  const int64_t m = m_;
  const T s = static_cast<T>(sqrt_scale_);
  gemm<T>(Trans::No, Trans::Yes, n, m, d, s, x, d, omega_, d, T(0), phi, dim_);
  const T half_log_m = T(0.5) * std::log(static_cast<T>(kind_ == FeatureMapKind::FavorPositive ? m : 2 * m));
  for (int64_t i = 0; i < n; ++i) {
    const T h = T(0.5) * s * s * simd::dot(x + i * d, x + i * d, static_cast<size_t>(d));  // ‖x̃‖²/2
    T* f = phi + i * dim_;  // f[0, m) holds U
    T ls;
    if (kind_ == FeatureMapKind::FavorPositive) {
      const T c = simd::max_value(f, static_cast<size_t>(m));
      simd::exp_shifted_sum(f, static_cast<size_t>(m), c);  // exp(U − max U)
      ls = c - h - half_log_m;
    } else if (kind_ == FeatureMapKind::FavorHyperbolic) {
      const T c = simd::max_abs(f, static_cast<size_t>(m));
      for (int64_t r = 0; r < m; ++r) f[m + r] = -f[r];
      simd::exp_shifted_sum(f, static_cast<size_t>(2 * m), c);
      ls = c - h - half_log_m;
    } else {
      require(simd::max_abs(f, static_cast<size_t>(m)) <= T(39000),
              "favor_attention: |ω·x| exceeds 39000, where trig features lose all accuracy; "
              "scale down the inputs");
      simd::sin_cos(f, static_cast<size_t>(m), f, f + m);  // in place: each lane read, then written
      ls = h - half_log_m;
    }
    if (log_scale) log_scale[i] = ls;
  }
}

template <class T>
void FeatureMap<T>::backward(const T* x, int64_t n, const T* phi, const T* dphi, T* dx,
                             T* scratch) const {
  const int64_t d = d_;
  switch (kind_) {
    case FeatureMapKind::Elu:  // d/dx (x + 1) = 1; d/dx exp(x) = exp(x) = φ
      for (int64_t i = 0; i < n * d; ++i) dx[i] = x[i] > 0 ? dphi[i] : dphi[i] * phi[i];
      return;
    case FeatureMapKind::Relu:
      for (int64_t i = 0; i < n * d; ++i) dx[i] = x[i] > 0 ? dphi[i] : T(0);
      return;
    case FeatureMapKind::Focused: {
      // φ = R·a/A with r = relu(x), a = rᵖ, R = ‖r‖, A = ‖a‖. For g = dL/dφ:
      // dL/dR = g·a/A;  dL/da = R·g/A − R·(g·a)·a/A³;  dL/dr = dL/dR·r/R + dL/da ∘ p·rᵖ⁻¹.
      const T p = static_cast<T>(focus_power_);
      for (int64_t i = 0; i < n; ++i) {
        const T* xr = x + i * d;
        const T* g = dphi + i * d;
        T* out = dx + i * d;
        T r2 = 0, a2 = 0, ga = 0;
        for (int64_t c = 0; c < d; ++c) {
          const T r = xr[c] > 0 ? xr[c] : T(0);
          const T a = r > 0 ? std::pow(r, p) : T(0);
          r2 += r * r;
          a2 += a * a;
          ga += g[c] * a;
        }
        if (a2 <= 0) {
          for (int64_t c = 0; c < d; ++c) out[c] = 0;
          continue;
        }
        const T R = std::sqrt(r2), A = std::sqrt(a2);
        const T dR = ga / A;
        for (int64_t c = 0; c < d; ++c) {
          const T r = xr[c] > 0 ? xr[c] : T(0);
          if (r <= 0) {
            out[c] = 0;
            continue;
          }
          const T a = std::pow(r, p);
          const T da = R * g[c] / A - R * ga * a / (A * A * A);
          out[c] = dR * r / R + da * p * std::pow(r, p - 1);
        }
      }
      return;
    }
    default: break;
  }
  // FAVOR, with x̃ = s·x and U = ωx̃:
  //  positive   ∂φ̃_r/∂x̃ = φ̃_r(ω_r − x̃)            → dx̃ = ωᵀ(g∘φ̃) − (g·φ̃)x̃
  //  hyperbolic ∂φ̃±_r/∂x̃ = φ̃±_r(±ω_r − x̃)         → dx̃ = ωᵀ(g⁺∘φ̃⁺ − g⁻∘φ̃⁻) − (g·φ̃)x̃
  //  trig       ∂φ̃s_r/∂x̃ = φ̃s_r x̃ + φ̃c_r ω_r, ∂φ̃c_r/∂x̃ = φ̃c_r x̃ − φ̃s_r ω_r
  //                                                → dx̃ = ωᵀ(gs∘φ̃c − gc∘φ̃s) + (g·φ̃)x̃
  // and dx = s·dx̃. The log-scale is held constant (see the header).
  const int64_t m = m_;
  const T s = static_cast<T>(sqrt_scale_);
  T* w = scratch;  // [n × m]: the coefficient of ω for each row
  for (int64_t i = 0; i < n; ++i) {
    const T* f = phi + i * dim_;
    const T* g = dphi + i * dim_;
    T* wr = w + i * m;
    const T gphi = simd::dot(g, f, static_cast<size_t>(dim_));
    T coef_x;  // coefficient of x̃
    const size_t mm = static_cast<size_t>(m);
    if (kind_ == FeatureMapKind::FavorPositive) {
      simd::product_difference(g, f, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr), wr, mm);
      coef_x = -gphi;
    } else if (kind_ == FeatureMapKind::FavorHyperbolic) {
      simd::product_difference(g, f, g + m, f + m, wr, mm);
      coef_x = -gphi;
    } else {
      simd::product_difference(g, f + m, g + m, f, wr, mm);
      coef_x = gphi;
    }
    // dx = s·(coef_x·s·x) here; s·ωᵀw is added by the product below.
    const T* xr = x + i * d;
    for (int64_t c = 0; c < d; ++c) dx[i * d + c] = coef_x * s * s * xr[c];
  }
  gemm<T>(Trans::No, Trans::No, n, d, m, s, w, m, omega_, d, T(1), dx, d);
}

template class FeatureMap<float>;
template class FeatureMap<double>;

}  // namespace linattn
