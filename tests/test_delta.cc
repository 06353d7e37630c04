// The gated delta rule and KDA (include/linattn/delta.h) against the float64 recurrence
// (src/linattn/delta/reference.cc) and, for the backward, against central finite differences of
// the forward in float64.
//
// Tolerance of the forward. With unit keys (as models use them: l2norm in the kernel or
// normalised keys) and β in [0, 2], every transition (I − β k kᵀ)·diag(α) has spectral norm
// <= 1, so ‖S_t‖ <= Σ := ‖S_0‖_F + Σ_i β_i ‖v_i‖, and an error made at one position is never
// amplified later. Each position's values come from sums of at most m = 2·d_k + 2·64 + 40 terms
// of size <= Σ (the state read K_B P over d_k, the triangular solve and the decayed scores over
// <= 64 each, the state's own update d_k + 64, and the decay factors' roundings as in
// test_gated.cc's 40), each within γ_m ≈ m·u relative (Higham 3.1). Summed over the n positions:
//   |S_fast − S| <= n·m·u·Σ,   |o_fast − o| <= |scale|·‖q_t‖·(n·m + d_k)·u·Σ
// (plus the float64 cumulative-sum error of test_gated.cc after resets, 2·64·u₆₄·B, relative).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "linattn/delta.h"
#include "linattn/delta/reference.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::random_tensor;

struct Case {
  int64_t batch, heads, key_heads, n, dk, dv;
  bool per_channel, initial, l2norm;
  const char* gates;  // testing::log_gates: "mixed", "near0", "resets", "gentle"
  double max_beta;    // β in [0, max_beta], with exact 0 and max_beta among them
};

template <class T>
Tensor<T> gates_for(const Case& c, uint64_t seed) {
  return testing::log_gates<T>(c.per_channel ? Shape{c.batch, c.heads, c.n, c.dk} : Shape{c.batch, c.heads, c.n}, c.gates, seed);
}

template <class T>
Tensor<T> betas_for(const Case& c, uint64_t seed) {
  Tensor<T> b = random_tensor<T>({c.batch, c.heads, c.n}, seed);
  for (int64_t i = 0; i < b.size(); ++i) {
    double x = std::fmod(std::fabs(static_cast<double>(b[i])), 1.0) * c.max_beta;
    if (i % 11 == 2) x = 0.0;
    if (i % 13 == 4) x = c.max_beta;
    b[i] = static_cast<T>(x);
  }
  return b;
}

// Keys of unit norm when the kernel does not normalise them (the regime of the bound above).
template <class T>
Tensor<T> keys_for(const Case& c, uint64_t seed) {
  Tensor<T> k = random_tensor<T>({c.batch, c.key_heads, c.n, c.dk}, seed);
  if (c.l2norm) return k;
  for (int64_t r = 0; r < k.size() / c.dk; ++r) {
    double sq = 0;
    for (int64_t e = 0; e < c.dk; ++e) sq += static_cast<double>(k[r * c.dk + e]) * static_cast<double>(k[r * c.dk + e]);
    for (int64_t e = 0; e < c.dk; ++e) k[r * c.dk + e] = static_cast<T>(static_cast<double>(k[r * c.dk + e]) / std::sqrt(sq));
  }
  return k;
}

template <class T>
std::vector<double> widen(const Tensor<T>& t) {
  std::vector<double> out(static_cast<size_t>(t.size()));
  for (int64_t i = 0; i < t.size(); ++i) out[i] = static_cast<double>(t[i]);
  return out;
}

struct Inputs {
  Tensor<double> q, k, v, g, beta, s0;
  Inputs(const Case& c, uint64_t seed)
      : q(random_tensor<double>({c.batch, c.key_heads, c.n, c.dk}, seed)), k(keys_for<double>(c, seed + 1)),
        v(random_tensor<double>({c.batch, c.heads, c.n, c.dv}, seed + 2)), g(gates_for<double>(c, seed + 3)),
        beta(betas_for<double>(c, seed + 4)),
        s0(c.initial ? random_tensor<double>({c.batch, c.heads, c.dk, c.dv}, seed + 5) : Tensor<double>()) {}
  TensorView<const double> init(const Case& c) const { return c.initial ? s0.view() : TensorView<const double>{}; }
};

template <class T>
void check_forward(const Case& c, int threads, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "H=" << c.heads << " Hk=" << c.key_heads << " n=" << c.n << " dk=" << c.dk
                                    << " dv=" << c.dv << " per_channel=" << c.per_channel << " initial=" << c.initial
                                    << " l2norm=" << c.l2norm << " gates=" << c.gates << " max_beta=" << c.max_beta
                                    << " threads=" << threads << " dtype=" << dtype_name<T>());
  testing::ScopedThreads scoped(threads);
  const Inputs in(c, seed);
  const double scale = 0.7;
  const GatedDeltaRuleOptions opts{scale, c.l2norm};
  const auto r = gated_delta_rule<T>(testing::cast<T>(in.q), testing::cast<T>(in.k), testing::cast<T>(in.v),
                                     testing::cast<T>(in.g), testing::cast<T>(in.beta),
                                     c.initial ? testing::cast<T>(in.s0).view() : TensorView<const T>{}, opts);
  // The reference on the inputs as the fast path saw them (rounded to T).
  const auto qd = widen(testing::cast<T>(in.q)), kd = widen(testing::cast<T>(in.k)), vd = widen(testing::cast<T>(in.v)),
             gd = widen(testing::cast<T>(in.g)), bd = widen(testing::cast<T>(in.beta));
  const auto sd = c.initial ? widen(testing::cast<T>(in.s0)) : std::vector<double>();
  const auto want = reference::gated_delta_rule(qd.data(), kd.data(), vd.data(), gd.data(), bd.data(),
                                                c.initial ? sd.data() : nullptr, c.batch, c.heads, c.key_heads, c.n,
                                                c.dk, c.dv, c.per_channel, scale, c.l2norm);
  const double u = std::numeric_limits<T>::epsilon() / 2, u64 = std::numeric_limits<double>::epsilon() / 2;
  const double m = 2.0 * c.dk + 2 * 64 + 40;
  // + 2·104·u for float32: its exponents are rounded before exp; + the cumulative sums' error
  const double exponent = std::is_same_v<T, float> ? 2.0 * 104 * u : 0.0;
  const double sums = 2.0 * 64 * u64 * 64 * 1000;
  const int64_t group = c.heads / c.key_heads;
  for (int64_t bh = 0; bh < c.batch * c.heads; ++bh) {
    double sigma = 0;  // Σ = ‖S_0‖_F + Σ β‖v‖
    if (c.initial) {
      double sq = 0;
      for (int64_t i = 0; i < c.dk * c.dv; ++i) sq += sd[bh * c.dk * c.dv + i] * sd[bh * c.dk * c.dv + i];
      sigma = std::sqrt(sq);
    }
    for (int64_t t = 0; t < c.n; ++t) {
      double sq = 0;
      for (int64_t e = 0; e < c.dv; ++e) sq += vd[(bh * c.n + t) * c.dv + e] * vd[(bh * c.n + t) * c.dv + e];
      sigma += bd[bh * c.n + t] * std::sqrt(sq);
    }
    const double state_tol = (c.n * m * u + exponent + sums) * sigma;
    const int64_t kt = bh / c.heads * c.key_heads + bh % c.heads / group;
    for (int64_t t = 0; t < c.n; ++t) {
      double qn = 0;
      for (int64_t e = 0; e < c.dk; ++e) qn += qd[(kt * c.n + t) * c.dk + e] * qd[(kt * c.n + t) * c.dk + e];
      qn = c.l2norm ? 1.0 : std::sqrt(qn);
      const double tol = scale * qn * ((c.n * m + c.dk) * u + exponent + sums) * sigma + 1e-300;
      for (int64_t e = 0; e < c.dv; ++e) {
        const int64_t i = (bh * c.n + t) * c.dv + e;
        ASSERT_LE(std::fabs(static_cast<double>(r.out[i]) - want.out[i]), tol) << "out " << i;
      }
    }
    for (int64_t i = bh * c.dk * c.dv; i < (bh + 1) * c.dk * c.dv; ++i)
      ASSERT_LE(std::fabs(static_cast<double>(r.state[i]) - want.state[i]), state_tol + 1e-300) << "state " << i;
  }
}

const Case kCases[] = {
    {1, 2, 2, 1, 4, 3, false, false, false, "mixed", 1.0},     {2, 3, 3, 63, 5, 7, true, true, true, "mixed", 1.0},
    {1, 2, 1, 64, 16, 16, false, false, true, "near0", 1.0},   {1, 4, 2, 65, 8, 4, true, true, false, "near0", 2.0},
    {2, 1, 1, 130, 17, 9, false, true, true, "resets", 1.0},   {1, 2, 2, 200, 32, 24, true, false, false, "resets", 1.0},
    {1, 3, 1, 97, 3, 2, false, true, false, "mixed", 2.0},     {1, 2, 1, 200, 16, 8, true, true, true, "gentle", 1.0},
    // up to 16 positions: the recurrence itself (decoding), not the chunks
    {2, 4, 2, 5, 16, 12, false, true, true, "resets", 1.0},  {1, 2, 2, 16, 9, 5, true, true, false, "mixed", 2.0},
    {1, 2, 1, 17, 9, 5, true, true, true, "near0", 1.0},
};

TEST(GatedDeltaRule, ForwardMatchesTheRecurrenceInFloat64AndFloat32) {
  uint64_t seed = 100;
  for (const Case& c : kCases)
    for (int threads : {1, 3, 8}) {
      check_forward<double>(c, threads, seed);
      check_forward<float>(c, threads, seed);
      seed += 10;
    }
}

TEST(GatedDeltaRule, EveryThreadCountGivesTheSameBits) {
  // One (batch, value head) per task: 1 to 16 threads, above and below batch·heads (2 to 12);
  // the decoding path (n <= 16) groups heads per thread, here 12 heads of 4·128·128.
  for (const Case& c : {Case{1, 4, 2, 150, 8, 6, false, true, true, "resets", 1.0},
                        Case{1, 2, 2, 150, 8, 6, true, true, false, "mixed", 2.0},
                        Case{1, 2, 2, 150, 8, 6, true, true, true, "gentle", 1.0},
                        Case{1, 12, 4, 4, 128, 128, false, true, true, "mixed", 1.0}}) {
    const Inputs in(c, 7);
    const auto f = [](const Tensor<double>& x) { return testing::cast<float>(x); };
    const auto q = f(in.q), k = f(in.k), v = f(in.v), g = f(in.g), beta = f(in.beta), s0 = f(in.s0);
    const auto dout = random_tensor<float>({1, c.heads, c.n, c.dv}, 5);
    const auto dstate = random_tensor<float>({1, c.heads, c.dk, c.dv}, 6);
    const GatedDeltaRuleOptions opts{std::nullopt, c.l2norm};
    testing::expect_same_bits_for_threads({1, 3, 8, 16}, [&] {
      auto r = gated_delta_rule<float>(q, k, v, g, beta, s0.view(), opts);
      auto gr = gated_delta_rule_backward<float>(q, k, v, g, beta, s0.view(), dout, dstate.view(), opts);
      std::vector<std::pair<std::string, Tensor<float>>> named;
      named.emplace_back("out", std::move(r.out));
      named.emplace_back("state", std::move(r.state));
      named.emplace_back("dq", std::move(gr.dq));
      named.emplace_back("dk", std::move(gr.dk));
      named.emplace_back("dv", std::move(gr.dv));
      named.emplace_back("dg", std::move(gr.dg));
      named.emplace_back("dbeta", std::move(gr.dbeta));
      named.emplace_back("dinitial_state", std::move(gr.dinitial_state));
      return named;
    });
  }
}

// positions [from, to) of a [B, H, n(, inner)] tensor
Tensor<double> rows(const Tensor<double>& x, int64_t from, int64_t to) {
  const int64_t inner = x.rank() == 4 ? x.dim(3) : 1, n = x.dim(2), bh = x.dim(0) * x.dim(1);
  Shape shape = x.shape();
  shape[2] = to - from;
  Tensor<double> y(shape);
  for (int64_t h = 0; h < bh; ++h)
    for (int64_t t = from; t < to; ++t)
      for (int64_t e = 0; e < inner; ++e) y[(h * (to - from) + t - from) * inner + e] = x[(h * n + t) * inner + e];
  return y;
}

TEST(GatedDeltaRule, TwoCallsOverASplitEqualOneCall) {
  for (bool per_channel : {false, true}) {
    const Case c{1, 4, 2, 150, 6, 5, per_channel, true, true, "mixed", 1.0};
    const Inputs in(c, 21);
    const GatedDeltaRuleOptions opts{std::nullopt, true};
    const auto whole = gated_delta_rule<double>(in.q, in.k, in.v, in.g, in.beta, in.s0.view(), opts);
    // inside a chunk, at its end, one position (a decoding step), a few (the recurrent path)
    for (int64_t cut : {int64_t{77}, int64_t{64}, int64_t{1}, int64_t{140}}) {
      const auto first = gated_delta_rule<double>(rows(in.q, 0, cut), rows(in.k, 0, cut), rows(in.v, 0, cut),
                                                  rows(in.g, 0, cut), rows(in.beta, 0, cut), in.s0.view(), opts);
      const auto second = gated_delta_rule<double>(rows(in.q, cut, 150), rows(in.k, cut, 150), rows(in.v, cut, 150),
                                                   rows(in.g, cut, 150), rows(in.beta, cut, 150), first.state.view(),
                                                   opts);
      const Tensor<double> out_a = rows(whole.out, 0, cut), out_b = rows(whole.out, cut, 150);
      for (int64_t i = 0; i < out_a.size(); ++i)
        ASSERT_NEAR(first.out[i], out_a[i], 1e-12 * (1 + std::fabs(out_a[i]))) << "cut " << cut;
      for (int64_t i = 0; i < out_b.size(); ++i)
        ASSERT_NEAR(second.out[i], out_b[i], 1e-12 * (1 + std::fabs(out_b[i]))) << "cut " << cut;
      for (int64_t i = 0; i < whole.state.size(); ++i)
        ASSERT_NEAR(second.state[i], whole.state[i], 1e-12 * (1 + std::fabs(whole.state[i]))) << "cut " << cut;
    }
  }
}

// Every entry of x against central differences of loss() (h = 1e−5), to 1e−7 of the largest
// gradient: truncation h²·|L‴| ~ 1e−10, cancellation u·|L|/h ~ 1e−11. Where x ± h leaves the
// domain (a log-gate within 2h of 0, β within 2h of 0 or 2), the one-sided second-order
// difference (±3L(x) ∓ 4L(x ∓ h) ± L(x ∓ 2h))/2h into the domain, accurate to the same order. A
// log-gate at or below the floor (or −inf) must have no gradient.
template <class Loss>
void expect_differences(const std::string& name, Tensor<double>& x, const Tensor<double>& grad, Loss loss) {
  double largest = 0;
  for (int64_t i = 0; i < grad.size(); ++i) largest = std::max(largest, std::fabs(grad[i]));
  ASSERT_GT(largest, 0) << name;
  const double h = 1e-5;
  for (int64_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    if (name == "g" && !(saved > -1000.0)) {
      ASSERT_EQ(grad[i], 0.0) << name << " " << i;
      continue;
    }
    auto at = [&](double value) {
      x[i] = value;
      const double l = loss();
      x[i] = saved;
      return l;
    };
    int side = 0;  // 0: central; −1: downwards only; +1: upwards only
    if (name == "g" && saved > -2 * h) side = -1;
    if (name == "beta" && saved < 2 * h) side = 1;
    if (name == "beta" && saved > 2 - 2 * h) side = -1;
    double numeric;
    if (side == 0)
      numeric = (at(saved + h) - at(saved - h)) / (2 * h);
    else
      numeric = side * (-3 * at(saved) + 4 * at(saved + side * h) - at(saved + 2 * side * h)) / (2 * h);
    ASSERT_NEAR(grad[i], numeric, 1e-7 * largest + 1e-9) << name << " " << i;
  }
}

TEST(GatedDeltaRule, EveryGradientMatchesCentralDifferencesInFloat64) {
  // Sizes give a last chunk of 6 and of 37 rows (partial blocks of 16 per channel), d_k or d_v
  // of 1, grouped heads, l2norm on and off, and calls without an initial state or without the
  // state's gradient. L = Σ w_o·out + Σ w_s·state.
  struct GradCase {
    Case c;
    bool with_dstate;
  };
  const GradCase cases[] = {{{1, 2, 2, 70, 3, 2, false, true, true, "mixed", 1.0}, true},
                            {{1, 2, 2, 70, 3, 2, true, true, false, "mixed", 1.0}, true},
                            {{1, 2, 1, 70, 3, 2, false, true, false, "resets", 2.0}, true},
                            {{1, 2, 2, 70, 3, 2, true, true, true, "resets", 1.0}, true},
                            {{1, 4, 2, 101, 2, 3, false, false, true, "mixed", 1.0}, true},
                            {{1, 2, 2, 101, 2, 3, true, true, true, "near0", 2.0}, false},
                            {{1, 2, 2, 37, 1, 4, true, false, false, "mixed", 1.0}, false},
                            {{1, 2, 1, 37, 4, 1, false, true, true, "resets", 1.0}, true},
                            {{1, 2, 2, 70, 3, 2, true, true, true, "gentle", 1.0}, true}};
  for (const GradCase& gc : cases) {
    const Case& c = gc.c;
    SCOPED_TRACE(::testing::Message() << "H=" << c.heads << " Hk=" << c.key_heads << " n=" << c.n << " dk=" << c.dk
                                      << " dv=" << c.dv << " per_channel=" << c.per_channel << " gates=" << c.gates
                                      << " l2norm=" << c.l2norm << " initial=" << c.initial
                                      << " dstate=" << gc.with_dstate);
    Inputs in(c, 31);
    const Tensor<double> w_out = random_tensor<double>({1, c.heads, c.n, c.dv}, 36);
    const Tensor<double> w_state =
        gc.with_dstate ? random_tensor<double>({1, c.heads, c.dk, c.dv}, 37) : Tensor<double>({1, c.heads, c.dk, c.dv});
    const GatedDeltaRuleOptions opts{0.6, c.l2norm};
    auto loss = [&] {
      const auto r = gated_delta_rule<double>(in.q, in.k, in.v, in.g, in.beta, in.init(c), opts);
      double l = 0;
      for (int64_t i = 0; i < r.out.size(); ++i) l += w_out[i] * r.out[i];
      for (int64_t i = 0; i < r.state.size(); ++i) l += w_state[i] * r.state[i];
      return l;
    };
    const auto grads = gated_delta_rule_backward<double>(in.q, in.k, in.v, in.g, in.beta, in.init(c), w_out.view(),
                                                         gc.with_dstate ? w_state.view() : TensorView<const double>{},
                                                         opts);
    expect_differences("q", in.q, grads.dq, loss);
    expect_differences("k", in.k, grads.dk, loss);
    expect_differences("v", in.v, grads.dv, loss);
    expect_differences("g", in.g, grads.dg, loss);
    expect_differences("beta", in.beta, grads.dbeta, loss);
    if (c.initial) expect_differences("initial_state", in.s0, grads.dinitial_state, loss);
  }
}

TEST(GatedDeltaRule, BadInputIsAnErrorNamingTheArgument) {
  const auto q = random_tensor<float>({1, 2, 8, 4}, 1), v = random_tensor<float>({1, 2, 8, 3}, 2);
  Tensor<float> g({1, 2, 8}), beta({1, 2, 8});
  const auto fails = [](auto&& call, const std::string& text) { testing::expect_error(call, text); };
  fails([&] { gated_delta_rule<float>(q, q, v, random_tensor<float>({1, 2, 7}, 3), beta, {}); }, "g has shape");
  fails([&] { gated_delta_rule<float>(q, q, v, g, Tensor<float>({1, 2, 7}), {}); }, "beta has shape");
  fails([&] { gated_delta_rule<float>(q, random_tensor<float>({1, 2, 8, 5}, 4), v, g, beta, {}); }, "k has shape");
  fails([&] { gated_delta_rule<float>(q, q, random_tensor<float>({1, 3, 8, 3}, 4), Tensor<float>({1, 3, 8}),
                                      Tensor<float>({1, 3, 8}), {}); },
        "must be a multiple of q's and k's heads");
  fails([&] { gated_delta_rule<float>(q, q, v, g, beta, Tensor<float>({1, 2, 4, 4}).view()); },
        "initial_state has shape");
  Tensor<float> positive({1, 2, 8});
  positive[5] = 0.5f;
  fails([&] { gated_delta_rule<float>(q, q, v, positive, beta, {}); }, "g must be <= 0");
  Tensor<float> nan({1, 2, 8});
  nan[2] = std::nanf("");
  fails([&] { gated_delta_rule<float>(q, q, v, nan, beta, {}); }, "g must be <= 0");
  for (float bad : {-0.1f, 2.5f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    Tensor<float> b({1, 2, 8});
    b[3] = bad;
    fails([&] { gated_delta_rule<float>(q, q, v, g, b, {}); }, "beta must be in [0, 2]");
  }
  for (const char* name : {"q", "k", "v"}) {
    Tensor<float> x = random_tensor<float>(std::string(name) == "v" ? Shape{1, 2, 8, 3} : Shape{1, 2, 8, 4}, 9);
    x[7] = std::numeric_limits<float>::infinity();
    const std::string n = name;
    fails([&] { gated_delta_rule<float>(n == "q" ? x : q, n == "k" ? x : q, n == "v" ? x : v, g, beta, {}); },
          n + " has a non-finite value");
  }
  fails([&] { gated_delta_rule<float>(q, q, v, g, beta, {}, GatedDeltaRuleOptions{std::nan(""), false}); },
        "scale must be finite");
  fails([&] { gated_delta_rule_backward<float>(q, q, v, g, beta, {}, random_tensor<float>({1, 2, 8, 2}, 5), {}); },
        "dout has shape");
}

TEST(GatedDeltaRule, AnEmptySequenceHandsBackTheInitialState) {
  const Case c{1, 2, 2, 0, 4, 3, false, true, false, "mixed", 1.0};
  const Inputs in(c, 41);
  const auto r = gated_delta_rule<double>(in.q, in.k, in.v, in.g, in.beta, in.s0.view());
  ASSERT_EQ(r.out.size(), 0);
  for (int64_t i = 0; i < r.state.size(); ++i) ASSERT_EQ(r.state[i], in.s0[i]);
  const auto dstate = random_tensor<double>({1, 2, 4, 3}, 42);
  const auto gr = gated_delta_rule_backward<double>(in.q, in.k, in.v, in.g, in.beta, in.s0.view(),
                                                    Tensor<double>({1, 2, 0, 3}).view(), dstate.view());
  for (int64_t i = 0; i < dstate.size(); ++i) ASSERT_EQ(gr.dinitial_state[i], dstate[i]);
}

}  // namespace
}  // namespace linattn
