// The causal depthwise convolution (include/linattn/conv1d.h) against its float64 definition
// (src/linattn/conv1d/reference.cc) and, for the backward, central differences in float64.
//
// Tolerance of the forward: z is a sum of W + 1 terms (bias and W products), so |z_fast − z| <=
// γ_{W+1}·A with A = |bias| + Σ_j |w_j x̃_{t+j}| (Higham 3.1); silu multiplies by σ(z) in
// [0, 1] and its slope |silu'| <= 1.1, and its own roundings (exp, +1, /, ·) add <= 8·u·|z| <=
// 8·u·A. So |out_fast − out| <= (1.1·(W + 1) + 8)·u·A (+ the inputs' rounding to float32, as
// the reference gets the same rounded inputs).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "linattn/conv1d.h"
#include "linattn/conv1d/reference.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::random_tensor;

struct Case {
  int64_t batch, channels, n, width;
  bool bias, initial, silu;
};

template <class T>
std::vector<double> widen(const Tensor<T>& t) {
  std::vector<double> out(static_cast<size_t>(t.size()));
  for (int64_t i = 0; i < t.size(); ++i) out[i] = static_cast<double>(t[i]);
  return out;
}

template <class T>
void check_forward(const Case& c, int threads, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "B=" << c.batch << " C=" << c.channels << " n=" << c.n << " W=" << c.width
                                    << " bias=" << c.bias << " initial=" << c.initial << " silu=" << c.silu
                                    << " threads=" << threads << " dtype=" << dtype_name<T>());
  testing::ScopedThreads scoped(threads);
  const auto x = testing::cast<T>(random_tensor<double>({c.batch, c.channels, c.n}, seed));
  const auto w = testing::cast<T>(random_tensor<double>({c.channels, c.width}, seed + 1));
  const auto b = testing::cast<T>(random_tensor<double>({c.channels}, seed + 2));
  const auto s0 = testing::cast<T>(random_tensor<double>({c.batch, c.channels, c.width - 1}, seed + 3));
  const auto r = causal_conv1d<T>(x, w, c.bias ? b.view() : TensorView<const T>{},
                                  c.initial ? s0.view() : TensorView<const T>{}, {c.silu});
  const auto xd = widen(x), wd = widen(w), bd = widen(b), sd = widen(s0);
  const auto want = reference::causal_conv1d(xd.data(), wd.data(), c.bias ? bd.data() : nullptr,
                                             c.initial ? sd.data() : nullptr, c.batch, c.channels, c.n, c.width,
                                             c.silu);
  // A: the same sums on magnitudes, without the activation
  std::vector<double> ax(xd.size()), aw(wd.size()), ab(bd.size()), as(sd.size());
  for (size_t i = 0; i < xd.size(); ++i) ax[i] = std::fabs(xd[i]);
  for (size_t i = 0; i < wd.size(); ++i) aw[i] = std::fabs(wd[i]);
  for (size_t i = 0; i < bd.size(); ++i) ab[i] = std::fabs(bd[i]);
  for (size_t i = 0; i < sd.size(); ++i) as[i] = std::fabs(sd[i]);
  const auto mag = reference::causal_conv1d(ax.data(), aw.data(), c.bias ? ab.data() : nullptr,
                                            c.initial ? as.data() : nullptr, c.batch, c.channels, c.n, c.width,
                                            false);
  const double u = std::numeric_limits<T>::epsilon() / 2;
  const double factor = (1.1 * (c.width + 1) + 8) * u;
  ASSERT_EQ(r.out.size(), static_cast<int64_t>(want.out.size()));
  for (int64_t i = 0; i < r.out.size(); ++i)
    ASSERT_LE(std::fabs(static_cast<double>(r.out[i]) - want.out[i]), factor * mag.out[i] + 1e-300) << "out " << i;
  for (int64_t i = 0; i < r.state.size(); ++i) ASSERT_EQ(static_cast<double>(r.state[i]), want.state[i]) << i;
}

TEST(CausalConv1d, ForwardMatchesItsDefinitionInFloat64AndFloat32) {
  uint64_t seed = 10;
  for (const Case& c : {Case{1, 3, 1, 4, true, true, true}, Case{2, 5, 17, 4, false, false, true},
                        Case{2, 7, 3, 4, true, false, false}, Case{1, 300, 40, 2, true, true, true},
                        Case{3, 2, 100, 1, true, true, true}, Case{1, 4, 0, 3, false, true, true}})
    for (int threads : {1, 3, 8}) {
      check_forward<double>(c, threads, seed);
      check_forward<float>(c, threads, seed);
      seed += 10;
    }
}

TEST(CausalConv1d, TwoCallsOverASplitEqualOneCallAndThreadsGiveTheSameBits) {
  const int64_t B = 2, C = 6, n = 30, W = 4;
  const auto x = random_tensor<double>({B, C, n}, 1), w = random_tensor<double>({C, W}, 2);
  const auto b = random_tensor<double>({C}, 3), s0 = random_tensor<double>({B, C, W - 1}, 4);
  const auto whole = causal_conv1d<double>(x, w, b.view(), s0.view());
  for (int64_t cut : {int64_t{1}, int64_t{2}, int64_t{13}}) {  // shorter than the state, and longer
    auto part = [&](int64_t from, int64_t to) {
      Tensor<double> y({B, C, to - from});
      for (int64_t r = 0; r < B * C; ++r)
        for (int64_t t = from; t < to; ++t) y[r * (to - from) + t - from] = x[r * n + t];
      return y;
    };
    const auto first = causal_conv1d<double>(part(0, cut), w, b.view(), s0.view());
    const auto second = causal_conv1d<double>(part(cut, n), w, b.view(), first.state.view());
    for (int64_t r = 0; r < B * C; ++r)
      for (int64_t t = 0; t < n; ++t)
        ASSERT_EQ(t < cut ? first.out[r * cut + t] : second.out[r * (n - cut) + t - cut], whole.out[r * n + t]);
    for (int64_t i = 0; i < whole.state.size(); ++i) ASSERT_EQ(second.state[i], whole.state[i]);
  }
  const auto xf = testing::cast<float>(x), wf = testing::cast<float>(w), bf = testing::cast<float>(b),
             sf = testing::cast<float>(s0), dout = random_tensor<float>({B, C, n}, 5),
             dstate = random_tensor<float>({B, C, W - 1}, 6);
  testing::expect_same_bits_for_threads({1, 2, 5, 16}, [&] {
    auto r = causal_conv1d<float>(xf, wf, bf.view(), sf.view());
    auto g = causal_conv1d_backward<float>(xf, wf, bf.view(), sf.view(), dout, dstate.view());
    std::vector<std::pair<std::string, Tensor<float>>> named;
    named.emplace_back("out", std::move(r.out));
    named.emplace_back("state", std::move(r.state));
    named.emplace_back("dx", std::move(g.dx));
    named.emplace_back("dweight", std::move(g.dweight));
    named.emplace_back("dbias", std::move(g.dbias));
    named.emplace_back("dinitial_state", std::move(g.dinitial_state));
    return named;
  });
}

// Central differences of L = Σ w_o·out + Σ w_s·state (testing::expect_gradient: h = 1e−5, to
// 1e−7·(1 + |g|)).
TEST(CausalConv1d, EveryGradientMatchesCentralDifferencesInFloat64) {
  for (const Case& c : {Case{2, 3, 9, 4, true, true, true}, Case{1, 2, 2, 4, true, true, false},
                        Case{2, 2, 5, 1, true, false, true}, Case{1, 3, 6, 3, false, true, true}}) {
    SCOPED_TRACE(::testing::Message() << "n=" << c.n << " W=" << c.width << " silu=" << c.silu);
    auto x = random_tensor<double>({c.batch, c.channels, c.n}, 21), w = random_tensor<double>({c.channels, c.width}, 22);
    auto b = random_tensor<double>({c.channels}, 23), s0 = random_tensor<double>({c.batch, c.channels, c.width - 1}, 24);
    const auto w_out = random_tensor<double>({c.batch, c.channels, c.n}, 25);
    const auto w_state = random_tensor<double>({c.batch, c.channels, c.width - 1}, 26);
    const CausalConv1dOptions opts{c.silu};
    auto bias = [&] { return c.bias ? b.view() : TensorView<const double>{}; };
    auto init = [&] { return c.initial ? s0.view() : TensorView<const double>{}; };
    auto loss = [&] {
      const auto r = causal_conv1d<double>(x, w, bias(), init(), opts);
      double l = 0;
      for (int64_t i = 0; i < r.out.size(); ++i) l += w_out[i] * r.out[i];
      for (int64_t i = 0; i < r.state.size(); ++i) l += w_state[i] * r.state[i];
      return l;
    };
    const auto g = causal_conv1d_backward<double>(x, w, bias(), init(), w_out, w_state.view(), opts);
    testing::expect_gradient(x, g.dx, loss, "x");
    testing::expect_gradient(w, g.dweight, loss, "weight");
    if (c.bias) testing::expect_gradient(b, g.dbias, loss, "bias");
    if (c.initial && c.width > 1) testing::expect_gradient(s0, g.dinitial_state, loss, "initial_state");
  }
}

TEST(CausalConv1d, BadInputIsAnErrorNamingTheArgument) {
  const auto x = random_tensor<float>({1, 3, 5}, 1), w = random_tensor<float>({3, 4}, 2);
  const auto fails = [](auto&& call, const std::string& text) { testing::expect_error(call, text); };
  fails([&] { causal_conv1d<float>(random_tensor<float>({3, 5}, 3), w, {}, {}); }, "x must be [batch, channels, seq]");
  fails([&] { causal_conv1d<float>(x, random_tensor<float>({2, 4}, 3), {}, {}); }, "weight has shape");
  fails([&] { causal_conv1d<float>(x, Tensor<float>({3, 0}), {}, {}); }, "weight must be [channels, width >= 1]");
  fails([&] { causal_conv1d<float>(x, w, Tensor<float>({2}).view(), {}); }, "bias has shape");
  fails([&] { causal_conv1d<float>(x, w, {}, Tensor<float>({1, 3, 4}).view()); }, "initial_state has shape");
  for (const char* name : {"x", "weight", "bias", "initial_state"}) {
    auto xx = random_tensor<float>({1, 3, 5}, 1), ww = random_tensor<float>({3, 4}, 2);
    auto bb = random_tensor<float>({3}, 5), ss = random_tensor<float>({1, 3, 3}, 6);
    const std::string n = name;
    Tensor<float>& bad = n == "x" ? xx : n == "weight" ? ww : n == "bias" ? bb : ss;
    bad[1] = std::numeric_limits<float>::quiet_NaN();
    fails([&] { causal_conv1d<float>(xx, ww, bb.view(), ss.view()); }, n + " has a non-finite value");
  }
  fails([&] { causal_conv1d_backward<float>(x, w, {}, {}, random_tensor<float>({1, 3, 4}, 7), {}); },
        "dout has shape");
}

}  // namespace
}  // namespace linattn
