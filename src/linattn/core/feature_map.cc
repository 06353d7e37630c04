#include "linattn/core/error.h"
#include "linattn/core/feature_map.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/simd.h"
#include "linattn/low_precision.h"

namespace linattn {

namespace {

struct PlainFeatureMapName {
  const char* name;
  FeatureMapKind kind;
  const char* formula;  // in the options' help; null: "given", which each method describes
};

// The plain maps' names, in the order the options list them.
constexpr PlainFeatureMapName kPlainFeatureMaps[] = {
    {"elu", FeatureMapKind::Elu, "elu(x)+1"},
    {"relu", FeatureMapKind::Relu, "max(x, 0)"},
    {"focused", FeatureMapKind::Focused, "relu, then ‖x‖·xᵖ/‖xᵖ‖ with p = focus_power"},
    {"given", FeatureMapKind::Given, nullptr}};

}  // namespace

const std::vector<std::string>& plain_feature_map_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const PlainFeatureMapName& m : kPlainFeatureMaps) out.emplace_back(m.name);
    return out;
  }();
  return names;
}

std::string fixed_feature_maps_help() {
  std::string out;
  for (const PlainFeatureMapName& m : kPlainFeatureMaps)
    if (m.formula) out += (out.empty() ? "" : ", ") + std::string(m.name) + " (" + m.formula + ")";
  return out;
}

const char* plain_feature_map_name(FeatureMapKind kind) {
  for (const PlainFeatureMapName& m : kPlainFeatureMaps)
    if (m.kind == kind) return m.name;
  fail("plain_feature_map_name: not a plain feature map");
}

FeatureMapKind parse_plain_feature_map(const char* fn, const std::string& name) {
  for (const PlainFeatureMapName& m : kPlainFeatureMaps)
    if (name == m.name) return m.kind;
  // Its name until 0.2 (issue 43: one name with the hybrid's "given"); accepted for one release,
  // the Python layers warn (OptionInfo::former_choices).
  if (name == kFormerGivenName) return FeatureMapKind::Given;
  fail(fn, ": feature_map must be ", plain_feature_map_choices(), "; got \"", name, "\"");
}

std::string plain_feature_map_choices(const char* also) {
  std::vector<std::string> names = plain_feature_map_names();
  if (also) names.emplace_back(also);
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + ("\"" + names[i] + "\"");
  return out;
}

double plain_feature_bound(const std::string& feature_map, double x_max, int64_t head_dim) {
  return plain_feature_bound(parse_plain_feature_map("plain_feature_bound", feature_map), x_max, head_dim);
}

double plain_feature_bound(FeatureMapKind kind, double x_max, int64_t head_dim) {
  switch (kind) {
    case FeatureMapKind::Elu: return x_max + 1;
    case FeatureMapKind::Relu:
    case FeatureMapKind::Given: return x_max;
    case FeatureMapKind::Focused: return std::sqrt(static_cast<double>(head_dim)) * x_max;
    default: fail("plain_feature_bound: not a plain feature map");
  }
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
  require(std::isfinite(focus_power) && focus_power >= 1 && focus_power <= kMaxFocusPower, fn,
          ": focus_power must be a number in [1, ", kMaxFocusPower, "], got ", focus_power);
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
          "; expected [num_features >= 1, ", head_dim, "] (the inputs' head_dim)");
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
  for (int64_t r = 0; r < f.m_; ++r) {
    double nrm = 0;
    for (int64_t c = 0; c < f.d_; ++c) nrm += double(f.omega_[r * f.d_ + c]) * double(f.omega_[r * f.d_ + c]);
    f.omega_norm_max_ = std::max(f.omega_norm_max_, std::sqrt(nrm));
  }
  return f;
}

// The type the focused map computes in: wider than T, so rᵖ keeps T's digits for any p.
template <class T>
using Wide = std::conditional_t<sizeof(T) == 4, double, long double>;

// One row of the focused map in the wide type W. φ = ‖r‖·rᵖ/‖rᵖ‖ is unchanged when r is divided
// by a power of two 2^e near its largest entry μ (exactly: no rounding), and then r̂ = r/2^e < 2
// and r̂ᵖ < 2ᵖ cannot overflow W for p <= kMaxFocusPower; W's pow is within an ulp of W, far below
// T's, so no digits are lost to p (dividing by μ itself would round r̂ and multiply that error
// by p). ‖r‖ = 2^e·‖r̂‖ cannot overflow either.
template <class T>
// r̂ᵖ itself fits W, but its squares do not (2^{2p}): the row keeps â = r̂ᵖ/max_c r̂_cᵖ, whose
// largest entry is 1, so ‖â‖² lies in [1, d] at any p.
struct FocusedRow {
  std::vector<Wide<T>> rh, a;  // r̂ and â = r̂ᵖ/max r̂ᵖ
  Wide<T> r2 = 0, a2 = 0;      // ‖r̂‖², ‖â‖²
  int e = 0;
  // False for a row with no positive entry (φ = 0 there).
  bool load(const T* x, int64_t d, double focus_power) {
    T mu = 0;
    for (int64_t c = 0; c < d; ++c) mu = std::max(mu, x[c]);
    if (!(mu > 0)) return false;
    rh.resize(static_cast<size_t>(d));
    a.resize(static_cast<size_t>(d));
    e = std::ilogb(mu);
    r2 = a2 = 0;
    const Wide<T> p = static_cast<Wide<T>>(focus_power);
    Wide<T> top = 0;
    for (int64_t c = 0; c < d; ++c) {
      rh[c] = x[c] > 0 ? std::ldexp(static_cast<Wide<T>>(x[c]), -e) : Wide<T>(0);
      a[c] = rh[c] > 0 ? std::pow(rh[c], p) : Wide<T>(0);
      r2 += rh[c] * rh[c];
      top = std::max(top, a[c]);
    }
    for (int64_t c = 0; c < d; ++c) {
      a[c] /= top;  // top = r̂_maxᵖ >= 1
      a2 += a[c] * a[c];
    }
    return true;
  }
};

template <class T>
int64_t FeatureMap<T>::scratch_size(int64_t n) const {
  // The backward's ∂loss/∂U; positive maps use ∂loss/∂L itself.
  return log_form() && kind_ != FeatureMapKind::FavorPositive ? n * m_ : 0;
}

// ---- plain maps -----------------------------------------------------------------------------

template <class T>
void FeatureMap<T>::features(const T* x, int64_t n, T* phi) const {
  const int64_t d = d_;
  switch (kind_) {
    case FeatureMapKind::Elu:
      simd::elu_plus_one(x, phi, static_cast<size_t>(n * d));
      return;
    case FeatureMapKind::Relu:
      simd::select_positive(x, x, static_cast<const T*>(nullptr), phi, static_cast<size_t>(n * d));
      return;
    case FeatureMapKind::Given:
      std::copy(x, x + n * d, phi);
      return;
    case FeatureMapKind::Focused: {
      thread_local FocusedRow<T> row;
      for (int64_t i = 0; i < n; ++i) {
        T* f = phi + i * d;
        if (!row.load(x + i * d, d, focus_power_)) {
          std::fill(f, f + d, T(0));
          continue;
        }
        const Wide<T> factor = std::ldexp(std::sqrt(row.r2), row.e) / std::sqrt(row.a2);  // a2 in [1, d]
        for (int64_t c = 0; c < d; ++c) f[c] = static_cast<T>(factor * row.a[c]);
      }
      return;
    }
    default: fail("FeatureMap::features: not a plain feature map");
  }
}

template <class T>
void FeatureMap<T>::features_backward(const T* x, int64_t n, const T* phi, const T* dphi, T* dx) const {
  const int64_t d = d_;
  switch (kind_) {
    case FeatureMapKind::Elu:  // d/dx (x + 1) = 1; d/dx exp(x) = exp(x) = φ
      simd::select_positive(x, dphi, phi, dx, static_cast<size_t>(n * d));
      return;
    case FeatureMapKind::Relu:
      simd::select_positive(x, dphi, static_cast<const T*>(nullptr), dx, static_cast<size_t>(n * d));
      return;
    case FeatureMapKind::Given:
      std::copy(dphi, dphi + n * d, dx);
      return;
    case FeatureMapKind::Focused: {
      // φ = R·a/A with r̂ = relu(x)/2^e (FocusedRow), a = r̂ᵖ, R = ‖relu(x)‖ = 2^e‖r̂‖, A = ‖a‖;
      // φ does not depend on e, so it is held constant. For g = dL/dφ:
      // dL/dR = g·a/A;  dL/da = R·g/A − R·(g·a)·a/A³;
      // dL/dx_c = dL/dR·r̂_c/‖r̂‖ + dL/da_c·p·r̂_c^(p−1)/2^e   (x_c > 0; 0 otherwise).
      // In the row's â = a/max a and Â = ‖â‖ (A³ would overflow W from p ≈ 340), with R̂ = ‖r̂‖:
      // dL/dR = g·â/Â;  dL/dx_c = dL/dR·r̂_c/R̂ + R̂·p·(â_c/r̂_c)·(g_c/Â − (g·â)·â_c/Â³).
      thread_local FocusedRow<T> row;
      const Wide<T> p = static_cast<Wide<T>>(focus_power_);
      for (int64_t i = 0; i < n; ++i) {
        const T* g = dphi + i * d;
        T* out = dx + i * d;
        if (!row.load(x + i * d, d, focus_power_)) {
          std::fill(out, out + d, T(0));
          continue;
        }
        Wide<T> ga = 0;
        for (int64_t c = 0; c < d; ++c) ga += g[c] * row.a[c];
        const Wide<T> Rh = std::sqrt(row.r2), A = std::sqrt(row.a2);
        const Wide<T> dR = ga / A;
        for (int64_t c = 0; c < d; ++c) {
          const Wide<T> rh = row.rh[c];
          if (rh <= 0) {
            out[c] = 0;
            continue;
          }
          const Wide<T> da = g[c] / A - ga * row.a[c] / (A * A * A);
          out[c] = static_cast<T>(dR * rh / Rh + Rh * p * (row.a[c] / rh) * da);
        }
      }
      return;
    }
    default: fail("FeatureMap::features_backward: not a plain feature map");
  }
}

// ---- FAVOR maps -----------------------------------------------------------------------------

template <class T>
void FeatureMap<T>::logits(const char* fn, const T* x, int64_t n, Side side, T* L, T* s, Products products,
                           const char* name) const {
  require(log_form(), "FeatureMap::logits: not a FAVOR feature map");
  const int64_t d = d_, m = m_;
  const T sq = static_cast<T>(sqrt_scale_);
  const char* who = name ? name : side == Side::Key ? "k" : "q";
  const bool with_norm = side != Side::Query;
  // U = x̃·ωᵀ, straight into the first m columns of L (positive, hyperbolic) or s (trig).
  T* U = kind_ == FeatureMapKind::FavorTrig ? s : L;
  times_projection(products, mat(U, n, m, dim_), mat(x, n, d), true, sq, T(0));
  // Every logit is finite when ‖x̃‖·max_r‖ω_r‖ and ‖x̃‖²/2 are (|ω_r·x̃| <= ‖x̃‖·‖ω_r‖):
  // checked per row from ‖x‖², which h needs anyway, rather than by a pass over the m logits.
  const double limit = static_cast<double>(std::numeric_limits<T>::max());
  for (int64_t i = 0; i < n; ++i) {
    const T* xr = x + i * d;
    T* u = U + i * dim_;
    const double xx = static_cast<double>(sq) * sq * simd::dot(xr, xr, static_cast<size_t>(d));  // ‖x̃‖²
    require(std::sqrt(xx) * omega_norm_max_ < limit && 0.5 * xx < limit, fn, ": a row of ", who,
            " is too large for ", dtype_name<T>(), " random features (‖x̃‖²/2 = ", 0.5 * xx,
            "); scale the inputs down or use float64");
    // ‖x̃‖²/2, for keys (and QueryWithNorm) only: on a plain query row it is one factor of every
    // feature, which cancels.
    const T h = with_norm ? static_cast<T>(0.5 * xx) : T(0);
    T* l = L + i * dim_;
    switch (kind_) {
      case FeatureMapKind::FavorPositive:
        if (with_norm)
          for (int64_t r = 0; r < m; ++r) l[r] = u[r] - h;
        break;
      case FeatureMapKind::FavorHyperbolic:
        for (int64_t r = 0; r < m; ++r) {
          const T ur = u[r];
          l[r] = ur - h;  // h = 0 on a plain query row
          l[m + r] = -ur - h;
        }
        break;
      default:  // trig
        require(simd::max_abs(u, static_cast<size_t>(m)) <= T(39000), fn,
                ": |ω·x̃| of a row of ", who, " exceeds 39000, where trig features lose all accuracy; scale down "
                "the inputs");
        simd::sin_cos(u, static_cast<size_t>(m), u, u + m);  // in place: each lane read, then written
        std::fill(l, l + dim_, h);
        break;
    }
  }
}

template <class T>
void FeatureMap<T>::logits_backward(const T* x, int64_t n, Side side, const T* dL, const T* s,
                                    const T* ds, T* dx, T* scratch, Products products) const {
  // With x̃ = √scale·x and U = x̃·ωᵀ: dx = √scale·(dU·ω + coef·x̃), coef = ∂loss/∂h (keys, and
  // trig, whose L = h): positive −Σ_r dL_r; hyperbolic −Σ_r (dL⁺_r + dL⁻_r); trig +Σ_r dL_r.
  //   positive   dU = dL
  //   hyperbolic dU = dL⁺ − dL⁻            (L = [U − h, −U − h])
  //   trig       dU = ds⁺∘cos U − ds⁻∘sin U (s = [sin U, cos U])
  const int64_t d = d_, m = m_;
  const T sq = static_cast<T>(sqrt_scale_);
  const size_t mm = static_cast<size_t>(m);
  // Positive: dU is dL itself (dim_ == m); the others build it in scratch [n × m].
  const bool positive = kind_ == FeatureMapKind::FavorPositive;
  T* dU = scratch;
  for (int64_t i = 0; i < n; ++i) {
    const T* g = dL + i * dim_;
    if (kind_ == FeatureMapKind::FavorHyperbolic) {
      for (int64_t r = 0; r < m; ++r) dU[i * m + r] = g[r] - g[m + r];
    } else if (!positive) {  // trig
      const T* si = s + i * dim_;
      const T* dsi = ds + i * dim_;
      simd::product_difference(dsi, si + m, dsi + m, si, dU + i * m, mm);
    }
    // Σ_r over all dim_ logits: positive m, hyperbolic and trig 2m.
    const T coef =
        side != Side::Query ? (positive || kind_ == FeatureMapKind::FavorHyperbolic ? T(-1) : T(1)) *
                                simd::sum(g, static_cast<size_t>(dim_))
                          : T(0);
    const T* xr = x + i * d;
    for (int64_t c = 0; c < d; ++c) dx[i * d + c] = coef * sq * sq * xr[c];
  }
  times_projection(products, mat(dx, n, d), mat(positive ? dL : static_cast<const T*>(dU), n, m), false, sq, T(1));
}

template <class T>
void FeatureMap<T>::times_projection(Products products, Mat<T> C, Mat<const T> A, bool transposed, T alpha,
                                     T beta) const {
  if constexpr (std::is_same_v<T, float>) {
    const Bf16PackedB* packed = transposed ? omega_t_packed_.get() : omega_packed_.get();
    if (products == Products::Bfloat16 && packed) return matmul_bf16(C, A, *packed, alpha, beta);
  }
  const Mat<const T> omega = mat(omega_, m_, d_);
  matmul<T>(products, C, A, transposed ? omega.t() : omega, alpha, beta);
}

template <class T>
void FeatureMap<T>::pack_projection() {
  if constexpr (std::is_same_v<T, float>) {
    require(log_form(), "FeatureMap::pack_projection: not a FAVOR feature map");
    omega_t_packed_ = std::make_shared<const Bf16PackedB>(mat(omega_, m_, d_).t());
    omega_packed_ = std::make_shared<const Bf16PackedB>(mat(omega_, m_, d_));
  } else {
    throw std::logic_error("FeatureMap::pack_projection: bfloat16 products are for float32 maps only");
  }
}

template <class T, class S>
void check_given_features(const char* fn, const char* name, const FeatureMap<T>& fmap, TensorView<const S> x,
                          const KeyMask* mask) {
  if (fmap.kind() != FeatureMapKind::Given) return;
  const auto value = [](S s) -> T {
    if constexpr (std::is_same_v<S, bfloat16>) return to_float(s);
    else return s;
  };
  const int64_t B = x.dim(0), H = x.dim(1), n = x.dim(2), m = x.dim(3);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t rows = mask ? std::min(n, mask->key_length(bh / H)) : n;
    const S* first = x.data + bh * n * m;
    const S* bad = std::find_if(first, first + rows * m, [&](S s) { return !(value(s) >= 0); });
    if (bad == first + rows * m) continue;
    const int64_t at = bad - x.data;
    fail(fn, ": with feature_map=\"given\", ", name, " holds features, which must be >= 0; got ", value(*bad),
         " at row ", at / m, " (counting over batch·heads·seq), feature ", at % m);
  }
}

template class FeatureMap<float>;
template void check_given_features(const char*, const char*, const FeatureMap<float>&,
                                   TensorView<const float>, const KeyMask*);
template void check_given_features(const char*, const char*, const FeatureMap<float>&,
                                   TensorView<const bfloat16>, const KeyMask*);
template class FeatureMap<double>;
template void check_given_features(const char*, const char*, const FeatureMap<double>&,
                                   TensorView<const double>, const KeyMask*);

}  // namespace linattn
