// The feature maps on their own (features, feature_logits, hedgehog_features and their
// backwards; include/linattn/kernelized.h) against the float64 reference's maps (reference::features), at the
// per-feature error bounds of kernelized_bounds.h, on odd sizes and at 1, 3 and 8 threads
// (bitwise the same at each); every backward against central differences in float64; bad input
// is an error naming the argument.
//
// The float32 backwards are the FeatureMap code that linear_attention's and favor_attention's
// gradient tests bound already; here the elu and relu slopes are checked in float32 as well.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "hedgehog_bounds.h"
#include "kernelized_bounds.h"
#include "linattn/core/feature_map.h"
#include "linattn/kernelized.h"
#include "linattn/registry.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::cast;
using testing::gamma;
using testing::random_tensor;
using testing::recurrent_options;

constexpr int64_t B = 2, H = 3, n = 37, d = 5, m = 7;  // odd sizes; 222 rows

// φ and ∂φ/∂x of every row of x [B,H,n,d] by the float64 reference: [rows, m'] and [rows, m', d].
struct ReferenceRows {
  Tensor<double> phi, jac;
};
ReferenceRows reference_rows(const Tensor<double>& x, const std::string& map,
                             std::optional<TensorView<const double>> projection = std::nullopt, double scale = 1,
                             double focus_power = 3) {
  const Tensor<double> flat = [&] {
    Tensor<double> t({x.size() / d, d});
    for (int64_t i = 0; i < x.size(); ++i) t[i] = x[i];
    return t;
  }();
  ReferenceRows r;
  r.phi = reference::features(flat.view(), map, projection, scale, focus_power, &r.jac);
  return r;
}

struct MapCase {
  std::string map;
  double focus_power = 3;
};

template <class T>
void expect_plain_map_within_bounds(const MapCase& c) {
  SCOPED_TRACE(c.map + " p=" + std::to_string(c.focus_power) + " " + dtype_name<T>());
  Tensor<double> x = random_tensor<double>({B, H, n, d}, 11);
  if (c.map == "given")
    for (int64_t i = 0; i < x.size(); ++i) x[i] = std::abs(x[i]);
  if (c.map != "given")  // a row with no positive entry (focused: φ = 0)
    for (int64_t c2 = 0; c2 < d; ++c2) x[c2] = -std::abs(x[c2]);
  const Tensor<T> xt = cast<T>(x);
  const Tensor<double> xd = cast<double>(xt);  // the values the fast path sees
  const ReferenceRows ref = reference_rows(xd, c.map, std::nullopt, 1, c.focus_power);
  RecurrentOptions opts = recurrent_options(c.map);
  opts.focus_power = c.focus_power;
  const double u = std::ldexp(1.0, -std::numeric_limits<T>::digits);
  std::optional<Tensor<T>> first;
  for (int threads : {1, 3, 8}) {
    const testing::ScopedThreads scoped(threads);
    Tensor<T> phi = features<T>(xt.view(), opts);
    ASSERT_EQ(phi.shape(), xt.shape());
    for (int64_t i = 0; i < phi.size(); ++i) {
      const double want = ref.phi[i], a = std::abs(want);
      // kernelized_bounds.h: elu 2.6u|φ| + 2⁻¹²⁶ (float32) or 2u|φ|; relu, given exact;
      // focused γ_{d+8}|φ|, plus half T's smallest subnormal where the wide result rounds into
      // T's subnormals or to 0 (focus_power 40 makes features far below float32's range).
      const double tiny = 0.5 * double(std::numeric_limits<T>::denorm_min());
      const double bound = c.map == "elu"       ? (std::is_same_v<T, float> ? 2.6 * u * a + std::ldexp(1.0, -126)
                                                                             : 2 * u * a)
                           : c.map == "focused" ? gamma<T>(d + 8) * a + tiny
                                                : 0.0;
      ASSERT_LE(std::abs(double(phi[i]) - want), bound) << "at " << i << ": " << phi[i] << " against " << want;
    }
    if (first) testing::expect_same_bits("features at another thread count", *first, phi);
    else first.emplace(std::move(phi));
  }
}

TEST(Features, PlainMapsMatchTheReference) {
  for (const MapCase& c : {MapCase{"elu"}, MapCase{"relu"}, MapCase{"focused"}, MapCase{"focused", 40},
                           MapCase{"given"}}) {
    testing::for_each_simd_target([&](auto) {
      expect_plain_map_within_bounds<float>(c);
      expect_plain_map_within_bounds<double>(c);
    });
  }
}

// FAVOR: c·s·exp(L − h_q) against the reference's φ, with c = 1/√m (positive, trig) or 1/√(2m)
// (hyperbolic), h_q = ‖x̃‖²/2 on the plain query side (left out of its logits) and 0 otherwise.
// Bound: kernelized_bounds.h's feature error with no stabilising shift (L = 0 there).
template <class T>
void expect_logits_within_bounds(const std::string& kernel, const std::string& side) {
  SCOPED_TRACE(kernel + " " + side + " " + dtype_name<T>());
  const double scale = 0.3;
  const Tensor<T> xt = cast<T>(random_tensor<double>({B, H, n, d}, 21));
  const Tensor<T> wt = cast<T>(random_tensor<double>({m, d}, 22));
  const Tensor<double> x = cast<double>(xt), w = cast<double>(wt);
  const ReferenceRows ref = reference_rows(x, kernel, w.view(), scale);
  RecurrentOptions opts = recurrent_options(kernel);
  opts.scale = scale;
  const double u = std::ldexp(1.0, -std::numeric_limits<T>::digits), s = std::sqrt(scale);
  const int64_t mp = kernel == "positive" ? m : 2 * m;
  const double c = kernel == "hyperbolic" ? 1 / std::sqrt(2.0 * m) : 1 / std::sqrt(double(m));
  std::optional<Tensor<T>> first;
  for (int threads : {1, 3, 8}) {
    const testing::ScopedThreads scoped(threads);
    FeatureLogits<T> f = feature_logits<T>(xt.view(), wt.view(), side, opts);
    ASSERT_EQ(f.logits.shape(), (Shape{B, H, n, mp}));
    ASSERT_EQ(f.factors.dim(3), kernel == "trig" ? mp : 0);
    for (int64_t i = 0; i < B * H * n; ++i) {
      const double* xr = x.data() + i * d;
      double h = 0, umax = 0;
      for (int64_t k = 0; k < d; ++k) h += 0.5 * scale * xr[k] * xr[k];
      std::vector<double> dU(m);
      for (int64_t r = 0; r < m; ++r) {
        double U = 0, absU = 0;
        for (int64_t k = 0; k < d; ++k) U += s * xr[k] * w[r * d + k], absU += s * std::abs(xr[k] * w[r * d + k]);
        dU[r] = gamma<T>(d + 1) * absU + u * std::abs(U);
        umax = std::max(umax, std::abs(U));
      }
      const double dUmax = *std::max_element(dU.begin(), dU.end());
      const double eta = 2 * dUmax + 2 * gamma<T>(d + 3) * h + u * 4 * (umax + h) + 8 * u;
      const double amp = std::exp(h) / std::sqrt(double(m));
      const double hq = side == "query" && kernel != "trig" ? h : 0;  // trig's query L is 0, its φ e^h·s/√m
      for (int64_t r = 0; r < mp; ++r) {
        const double L = f.logits[i * mp + r], fac = kernel == "trig" ? double(f.factors[i * mp + r]) : 1.0;
        const double got = kernel == "trig" && side == "query" ? amp * fac : c * fac * std::exp(L - hq);
        const double want = ref.phi[i * mp + r];
        const double bound = kernel == "trig" ? amp * (dU[r % m] + 4 * u) + eta * std::abs(want) : eta * std::abs(want);
        ASSERT_LE(std::abs(got - want), bound) << "row " << i << " feature " << r;
        if (kernel == "trig" && side == "query") {
          ASSERT_EQ(L, 0);
        }
      }
    }
    if (first) {
      testing::expect_same_bits("logits at another thread count", *first, f.logits);
    } else {
      first.emplace(std::move(f.logits));
    }
  }
}

TEST(Features, FavorLogitsMatchTheReference) {
  for (const char* kernel : {"positive", "hyperbolic", "trig"})
    for (const char* side : {"key", "query", "query_with_norm"}) {
      expect_logits_within_bounds<float>(kernel, side);
      expect_logits_within_bounds<double>(kernel, side);
    }
}

TEST(Features, PlainBackwardsMatchFiniteDifferences) {
  for (const MapCase& c : {MapCase{"elu"}, MapCase{"relu"}, MapCase{"focused"}, MapCase{"focused", 5.5},
                           MapCase{"focused", 400}, MapCase{"given"}}) {
    SCOPED_TRACE(c.map);
    Tensor<double> x = random_tensor<double>({1, 2, 3, d}, 31);
    if (c.map == "given")
      for (int64_t i = 0; i < x.size(); ++i) x[i] = std::abs(x[i]) + 0.1;
    const Tensor<double> g = random_tensor<double>(x.shape(), 32);
    RecurrentOptions opts = recurrent_options(c.map);
    opts.focus_power = c.focus_power;
    const Tensor<double> dx = features_backward<double>(x.view(), g.view(), opts);
    testing::expect_gradient(x, dx, [&] { return testing::dot_loss(features<double>(x.view(), opts), g); }, "x");
  }
}

// The focused map at the largest focus_power, 1000, where (r̂ᵖ)² and A³ leave even the wide type's
// range: the row's largest entry takes the whole norm, φ = ‖r‖·e_max to the rounding (the other
// entries' (r_c/r_max)^1000 are below 10⁻¹⁰⁰), and the backward is finite and equals central
// differences (float64).
TEST(Features, FocusedAtTheLargestFocusPower) {
  const double row[d] = {1.9, 1.0, -1.0, 0.5, 1.5};
  const double norm = std::sqrt(1.9 * 1.9 + 1.0 + 0.25 + 2.25);
  RecurrentOptions opts = recurrent_options("focused");
  opts.focus_power = 1000;
  Tensor<double> x({1, 1, 1, d});
  for (int64_t c = 0; c < d; ++c) x[c] = row[c];
  const Tensor<float> phi32 = features<float>(cast<float>(x).view(), opts);
  const Tensor<double> phi64 = features<double>(x.view(), opts);
  EXPECT_NEAR(phi32[0], norm, 4 * std::ldexp(norm, -24));
  EXPECT_NEAR(phi64[0], norm, 4 * std::ldexp(norm, -53));
  for (int64_t c = 1; c < d; ++c) {
    EXPECT_LE(std::abs(phi64[c]), 1e-100);
    EXPECT_EQ(phi32[c], 0.0f);
  }
  const Tensor<double> g = random_tensor<double>(x.shape(), 71);
  const Tensor<double> dx = features_backward<double>(x.view(), g.view(), opts);
  for (int64_t c = 0; c < d; ++c) ASSERT_TRUE(std::isfinite(dx[c]));
  testing::expect_gradient(x, dx, [&] { return testing::dot_loss(features<double>(x.view(), opts), g); }, "x");
}

// elu and relu in float32 against the reference's Jacobian: dx_c = g_c·φ'(x_c), φ' = 1 or φ
// (elu, φ within 2.6u|φ| + 2⁻¹²⁶, then one rounded product: 3.6u|g φ| + 2⁻¹²⁶|g|), relu exact.
TEST(Features, Float32SlopesMatchTheReference) {
  for (const char* map : {"elu", "relu"}) {
    SCOPED_TRACE(map);
    const Tensor<float> xt = cast<float>(random_tensor<double>({B, H, n, d}, 41));
    const Tensor<float> gt = cast<float>(random_tensor<double>({B, H, n, d}, 42));
    const Tensor<double> x = cast<double>(xt);
    const ReferenceRows ref = reference_rows(x, map);
    const Tensor<float> dx = features_backward<float>(xt.view(), gt.view(), recurrent_options(map));
    const double u = std::ldexp(1.0, -24);
    for (int64_t i = 0; i < x.size(); ++i) {
      const int64_t row = i / d, col = i % d;
      const double slope = ref.jac[(row * d + col) * d + col], want = double(gt[i]) * slope;
      const double bound = std::string(map) == "elu" ? 3.6 * u * std::abs(want) + std::ldexp(std::abs(double(gt[i])), -126) : 0;
      ASSERT_LE(std::abs(double(dx[i]) - want), bound) << "at " << i;
    }
  }
}

TEST(Features, FavorBackwardsMatchFiniteDifferences) {
  for (const char* kernel : {"positive", "hyperbolic", "trig"})
    for (const char* side : {"key", "query", "query_with_norm"}) {
      SCOPED_TRACE(std::string(kernel) + " " + side);
      Tensor<double> x = random_tensor<double>({1, 2, 3, d}, 51);
      const Tensor<double> w = random_tensor<double>({m, d}, 52);
      RecurrentOptions opts = recurrent_options(kernel);
      opts.scale = 0.4;
      const int64_t mp = std::string(kernel) == "positive" ? m : 2 * m;
      const Tensor<double> gL = random_tensor<double>({1, 2, 3, mp}, 53), gs = random_tensor<double>({1, 2, 3, mp}, 54);
      const bool trig = std::string(kernel) == "trig";
      const auto loss = [&] {
        const FeatureLogits<double> f = feature_logits<double>(x.view(), w.view(), side, opts);
        return testing::dot_loss(f.logits, gL) + (trig ? testing::dot_loss(f.factors, gs) : 0.0);
      };
      const Tensor<double> dx = feature_logits_backward<double>(
          x.view(), w.view(), side, gL.view(),
          trig ? std::optional<TensorView<const double>>(gs.view()) : std::nullopt, opts);
      testing::expect_gradient(x, dx, loss, "x");
    }
}

// The plain maps are named in one list (core/feature_map.cc): every method's feature_map option
// offers exactly those (the hybrid FAVOR's too), each name parses to a kind that names it back,
// and plain_feature_bound, which the kernels refuse out-of-range inputs by, holds.
TEST(Features, PlainMapsAreNamedOnceAndTheirBoundHolds) {
  const std::vector<std::string>& names = plain_feature_map_names();
  ASSERT_EQ(names, (std::vector<std::string>{"elu", "relu", "focused", "given"}));
  auto choices = [](const char* method_name) {
    for (const OptionInfo& o : method(method_name).options)
      if (o.name == "feature_map") return o.choices;
    return std::vector<std::string>{};
  };
  EXPECT_EQ(choices("linear"), names);
  std::vector<std::string> hybrid = names;
  hybrid.emplace_back("favor");
  EXPECT_EQ(choices("hybrid"), hybrid);
  EXPECT_EQ(plain_feature_map_choices("favor"), "\"elu\", \"relu\", \"focused\", \"given\" or \"favor\"");
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    EXPECT_EQ(plain_feature_map_name(parse_plain_feature_map("test", name)), name);
    // Rows whose largest |value| is x_max; "given" takes features, so its rows are made >= 0.
    for (const double x_max : {0.25, 1.0, 40.0}) {
      Tensor<double> x = random_tensor<double>({1, 2, 41, d}, 71);
      double top = 0;
      for (int64_t i = 0; i < x.size(); ++i) {
        if (name == "given") x[i] = std::abs(x[i]);
        top = std::max(top, std::abs(x[i]));
      }
      for (int64_t i = 0; i < x.size(); ++i) x[i] *= x_max / top;
      // The first row [x_max, −x_max, ...] (given: [x_max, 0, ...]) reaches x_max (elu: x_max + 1)
      // in its first feature; focused's φ there is ‖r‖ = x_max.
      x[0] = x_max;
      for (int64_t i = 1; i < d; ++i) x[i] = name == "given" ? 0 : -x_max;
      const Tensor<double> phi = features<double>(x.view(), recurrent_options(name));
      double phi_max = 0;
      for (int64_t i = 0; i < phi.size(); ++i) phi_max = std::max(phi_max, phi[i]);
      // The bound is the exact value's; φ is computed with a few roundings (focused: its norms,
      // powers and quotient, at most d + 8 of them: γ_{d+8}), so it may exceed it by that much.
      const double bound = plain_feature_bound(name, x_max, d);
      EXPECT_LE(phi_max, bound * (1 + gamma<double>(d + 8))) << "x_max " << x_max;
      EXPECT_GE(phi_max, (name == "elu" ? 1 + x_max : x_max) * (1 - gamma<double>(d + 8)))
          << "the first row's first feature";
    }
  }
  testing::expect_error([] { plain_feature_bound("softmax", 1, d); },
                        "plain_feature_bound: feature_map must be \"elu\", \"relu\", \"focused\" or \"given\"; got "
                        "\"softmax\"");
}

TEST(Features, BadInputIsAnError) {
  const Tensor<double> x = random_tensor<double>({1, 2, 3, d}, 61);
  const Tensor<double> w = random_tensor<double>({m, d}, 62);
  const RecurrentOptions elu = recurrent_options("elu"), favor = recurrent_options("positive");
  using testing::expect_error;
  expect_error([&] { features<double>(Tensor<double>({2, 3, d}).view(), elu); },
               "features: x must be [batch, heads, n, head_dim], got shape [2, 3, 5]");
  Tensor<double> bad = cast<double>(x);
  bad[4] = std::nan("");
  expect_error([&] { features<double>(bad.view(), elu); }, "features: x");
  expect_error([&] { features<double>(x.view(), recurrent_options("softmax")); },
               "features: feature_map must be \"elu\", \"relu\", \"focused\" or \"given\"; got \"softmax\"");
  expect_error([&] { features<double>(x.view(), favor); }, "features: feature_map=\"favor\" is in log form");
  RecurrentOptions focused = recurrent_options("focused");
  focused.focus_power = 0.5;
  expect_error([&] { features<double>(x.view(), focused); }, "focus_power must be a number in [1, 1000], got 0.5");
  expect_error([&] { features<double>(x.view(), recurrent_options("given")); },
               "with feature_map=\"given\", x holds features, which must be >= 0");
  expect_error([&] { features_backward<double>(x.view(), Tensor<double>({1, 2, 3, d + 1}).view(), elu); },
               "features_backward: dphi has shape [1, 2, 3, 6]; expected [1, 2, 3, 5]");
  expect_error([&] { feature_logits<double>(x.view(), w.view(), "keys", favor); },
               "feature_logits: side must be \"query\", \"key\" or \"query_with_norm\"; got \"keys\"");
  expect_error([&] { feature_logits<double>(x.view(), w.view(), "key", elu); },
               "feature_logits: feature_map must be \"favor\"");
  expect_error([&] { feature_logits<double>(x.view(), Tensor<double>({m, d + 1}).view(), "key", favor); },
               "projection has shape [7, 6]; expected [num_features >= 1, 5]");
  RecurrentOptions zero = favor;
  zero.scale = 0;
  expect_error([&] { feature_logits<double>(x.view(), w.view(), "key", zero); }, "scale must be > 0");
  expect_error([&] { feature_logits_backward<double>(x.view(), w.view(), "key", Tensor<double>({1, 2, 3, m}).view(),
                                                     Tensor<double>({1, 2, 3, m}).view(), favor); },
               "dfactors is only used with kernel=\"trig\"");
  expect_error([&] { feature_logits_backward<double>(x.view(), w.view(), "key", Tensor<double>({1, 2, 3, m + 1}).view(),
                                                     std::nullopt, favor); },
               "feature_logits_backward: dlogits has shape [1, 2, 3, 8]; expected [1, 2, 3, 7]");
  Tensor<double> huge = cast<double>(x);
  huge[0] = 1e200;
  expect_error([&] { feature_logits<double>(huge.view(), w.view(), "key", favor); },
               "feature_logits: a row of x is too large for float64");
  RecurrentOptions trig = recurrent_options("trig");
  Tensor<double> wide = cast<double>(x);
  wide[0] = 1e5;
  expect_error([&] { feature_logits<double>(wide.view(), w.view(), "query", trig); },
               "feature_logits: |ω·x̃| of a row of x exceeds 39000");
}

// Hedgehog's learned map against reference::hedgehog_features (textbook softmaxes in float64)
// at hedgehog_bounds.h's ρ per feature (the fast path's in T plus the reference's own in
// float64), on rows spanning one, two and sixteen row blocks (n = 37, 300, 4100: the blocks are
// at least 256 rows, at most 16 per item), at 1, 3, 8 and 16 threads (6 items: below and
// above), bitwise the same at each;
// the backward bitwise the same at each thread count too (∂W sums its blocks in a fixed order).
template <class T>
void expect_hedgehog_within_bound(int64_t rows, int64_t f) {
  SCOPED_TRACE("n " + std::to_string(rows) + " f " + std::to_string(f) + " " + dtype_name<T>());
  const Tensor<double> x = cast<double>(cast<T>(random_tensor<double>({B, H, rows, d}, 81)));
  const Tensor<double> W = cast<double>(cast<T>(random_tensor<double>({H, d, f}, 82, 0.7)));
  const Tensor<double> b = cast<double>(cast<T>(random_tensor<double>({H, f}, 83, 0.3)));
  const Tensor<double> want = reference::hedgehog_features(x.view(), W.view(), b.view());
  const double rho = testing::hedgehog_bound<T>(x, W, b) + testing::hedgehog_bound<double>(x, W, b);
  Tensor<double> bound(want.shape());
  for (int64_t i = 0; i < want.size(); ++i) bound[i] = rho * want[i];
  const Tensor<T> xt = cast<T>(x), Wt = cast<T>(W), bt = cast<T>(b);
  const Tensor<double> g = random_tensor<double>({B, H, rows, 2 * f}, 84);
  const Tensor<T> gt = cast<T>(g);
  std::optional<Tensor<T>> first;
  std::optional<HedgehogGrads<T>> first_grads;
  for (int threads : {1, 3, 8, 16}) {
    const testing::ScopedThreads scoped(threads);
    Tensor<T> phi = hedgehog_features<T>(xt.view(), Wt.view(), bt.view());
    testing::expect_within(phi, want, bound, "phi");
    HedgehogGrads<T> grads = hedgehog_features_backward<T>(xt.view(), Wt.view(), bt.view(), gt.view());
    // φ given (as torch's layer saves it) is the φ the backward would make: the same bits
    const HedgehogGrads<T> saved = hedgehog_features_backward<T>(xt.view(), Wt.view(), bt.view(), gt.view(), phi.view());
    testing::expect_identical(saved.dx, grads.dx, "dx with phi given");
    testing::expect_identical(saved.dweight, grads.dweight, "dweight with phi given");
    testing::expect_identical(saved.dbias, grads.dbias, "dbias with phi given");
    if (!first) {
      first = std::move(phi);
      first_grads = std::move(grads);
      continue;
    }
    for (int64_t i = 0; i < phi.size(); ++i) ASSERT_EQ(phi[i], (*first)[i]) << "at " << i;
    for (const auto& [got, ref] : {std::pair{&grads.dx, &first_grads->dx}, std::pair{&grads.dweight, &first_grads->dweight},
                                   std::pair{&grads.dbias, &first_grads->dbias}})
      for (int64_t i = 0; i < got->size(); ++i) ASSERT_EQ((*got)[i], (*ref)[i]) << "gradient at " << i;
  }
}

TEST(Features, HedgehogMatchesTheReference) {
  for (int64_t rows : {int64_t{37}, int64_t{300}, int64_t{4100}})
    for (int64_t f : {int64_t{1}, int64_t{7}, int64_t{32}}) {
      if (rows == 4100 && f != 7) continue;  // the many-block case once
      expect_hedgehog_within_bound<float>(rows, f);
      expect_hedgehog_within_bound<double>(rows, f);
    }
}

// Large logits (|u| up to ~400, where the reference's unshifted exp overflows): each half is
// shifted by its own maximum, so the features stay finite and each half sums to 1.
TEST(Features, HedgehogLargeLogitsStayFinite) {
  Tensor<double> x = random_tensor<double>({1, 1, 4, d}, 85, 80.0);
  const Tensor<double> W = random_tensor<double>({1, d, 3}, 86);
  const Tensor<double> b({1, 3});
  const Tensor<float> phi = hedgehog_features<float>(cast<float>(x).view(), cast<float>(W).view(), cast<float>(b).view());
  for (int64_t row = 0; row < 4; ++row) {
    double plus = 0, minus = 0;
    for (int64_t j = 0; j < 3; ++j) {
      ASSERT_TRUE(std::isfinite(phi[row * 6 + j]) && std::isfinite(phi[row * 6 + 3 + j]));
      plus += phi[row * 6 + j];
      minus += phi[row * 6 + 3 + j];
    }
    EXPECT_NEAR(plus, 1.0, 1e-6);
    EXPECT_NEAR(minus, 1.0, 1e-6);
  }
}

TEST(Features, HedgehogBackwardMatchesFiniteDifferences) {
  for (int64_t rows : {int64_t{3}, int64_t{300}}) {  // one block; two blocks of ∂W summed
    SCOPED_TRACE(rows);
    Tensor<double> x = random_tensor<double>({2, 2, rows, d}, 91);
    Tensor<double> W = random_tensor<double>({2, d, 4}, 92, 0.7);
    Tensor<double> b = random_tensor<double>({2, 4}, 93, 0.3);
    const Tensor<double> g = random_tensor<double>({2, 2, rows, 8}, 94);
    const HedgehogGrads<double> grads = hedgehog_features_backward<double>(x.view(), W.view(), b.view(), g.view());
    const auto loss = [&] { return testing::dot_loss(hedgehog_features<double>(x.view(), W.view(), b.view()), g); };
    if (rows == 3) testing::expect_gradient(x, grads.dx, loss, "x");  // 60 entries (at 300 rows: 6000 pairs of forwards)
    testing::expect_gradient(W, grads.dweight, loss, "weight");
    testing::expect_gradient(b, grads.dbias, loss, "bias");
  }
}

TEST(Features, HedgehogBadInputIsAnError) {
  const Tensor<double> x = random_tensor<double>({1, 2, 3, d}, 95);
  const Tensor<double> W = random_tensor<double>({2, d, 4}, 96), b = random_tensor<double>({2, 4}, 97);
  using testing::expect_error;
  expect_error([&] { hedgehog_features<double>(Tensor<double>({2, 3, d}).view(), W.view(), b.view()); },
               "hedgehog_features: x must be [batch, heads, n, head_dim], got shape [2, 3, 5]");
  expect_error([&] { hedgehog_features<double>(x.view(), Tensor<double>({3, d, 4}).view(), b.view()); },
               "hedgehog_features: weight has shape [3, 5, 4]; expected [heads = 2, head_dim = 5, feature_dim >= 1]");
  expect_error([&] { hedgehog_features<double>(x.view(), Tensor<double>({2, d, 0}).view(), Tensor<double>({2, 0}).view()); },
               "hedgehog_features: weight has shape [2, 5, 0]");
  expect_error([&] { hedgehog_features<double>(x.view(), W.view(), Tensor<double>({2, 5}).view()); },
               "hedgehog_features: bias has shape [2, 5]; expected [2, 4]");
  Tensor<double> bad = cast<double>(W);
  bad[3] = std::numeric_limits<double>::infinity();
  expect_error([&] { hedgehog_features<double>(x.view(), bad.view(), b.view()); },
               "hedgehog_features: weight has a non-finite value at flat index 3");
  Tensor<double> bad_x = cast<double>(x);
  bad_x[1] = std::nan("");
  expect_error([&] { hedgehog_features<double>(bad_x.view(), W.view(), b.view()); }, "hedgehog_features: x");
  expect_error([&] { hedgehog_features_backward<double>(x.view(), W.view(), b.view(), Tensor<double>({1, 2, 3, 4}).view()); },
               "hedgehog_features_backward: dphi has shape [1, 2, 3, 4]; expected [1, 2, 3, 8]");
  const Tensor<double> g({1, 2, 3, 8});
  expect_error([&] { hedgehog_features_backward<double>(x.view(), W.view(), b.view(), g.view(), Tensor<double>({1, 2, 3, 7}).view()); },
               "hedgehog_features_backward: phi has shape [1, 2, 3, 7]; expected [1, 2, 3, 8]");
}

}  // namespace
}  // namespace linattn
