// RecurrentState: decoding one token at a time (and prefill + steps) gives the causal
// outputs; copy() rolls back; FAVOR's per-feature shifts keep large norms finite; two threads
// on one state are refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "kernelized_bounds.h"
#include "linattn/random_features.h"
#include "linattn/kernelized.h"
#include "test_util.h"

namespace linattn {
namespace {

using ::testing::HasSubstr;
using testing::cast;
using testing::error_of;
using testing::random_tensor;
using testing::recurrent_options;
using testing::rows;

// Rows t of a [B,H,n,D] tensor as [B,H,D].
template <class T>
Tensor<T> at(const Tensor<T>& x, int64_t t) {
  const int64_t B = x.dim(0), H = x.dim(1), n = x.dim(2), D = x.dim(3);
  Tensor<T> y({B, H, D});
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t c = 0; c < D; ++c) y[bh * D + c] = x[(bh * n + t) * D + c];
  return y;
}

// Step-by-step for all n tokens, and prefill(first 70) + steps, against the exact causal
// outputs within the bounds of kernelized_bounds.h (the state's sums are one more ordering of
// the same terms).
template <class T>
void check_decoding(const std::string& map, double sigma) {
  const int64_t B = 2, H = 2, n = 100, d = 16, dv = 8;
  auto qd = random_tensor<double>({B, H, n, d}, 1, sigma), kd = random_tensor<double>({B, H, n, d}, 2, sigma);
  if (map == "given")  // given features are >= 0
    for (Tensor<double>* x : {&qd, &kd})
      for (int64_t i = 0; i < x->size(); ++i) (*x)[i] = std::abs((*x)[i]);
  const auto q = cast<T>(qd), k = cast<T>(kd);
  const auto v = cast<T>(random_tensor<double>({B, H, n, dv}, 3));
  const auto w = random_features<T>(32, d, FeatureKind::Orthogonal, 4);
  const RecurrentOptions o = recurrent_options(map);
  const bool favor = o.feature_map == "favor";
  testing::KernelizedSpec spec;
  spec.map = map;
  spec.causal = true;
  const auto wd = cast<double>(w);
  const auto exact = testing::kernelized_exact_with_bounds<T>(
      cast<double>(q), cast<double>(k), cast<double>(v), Tensor<double>(v.shape()), &wd, spec);
  auto expect_row = [&](const Tensor<T>& out_t, int64_t t, const char* what) {
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t c = 0; c < dv; ++c) {
        const int64_t i = (bh * n + t) * dv + c;
        ASSERT_NEAR(out_t[bh * dv + c], exact.out[i], exact.out_bound[i]) << what << " t=" << t;
      }
  };
  RecurrentState<T> s(B, H, d, dv, o, favor ? std::optional<TensorView<const T>>(w.view()) : std::nullopt);
  for (int64_t t = 0; t < n; ++t) expect_row(s.step(at(q, t), at(k, t), at(v, t)), t, "step");
  EXPECT_EQ(s.tokens(), n);

  RecurrentState<T> p(B, H, d, dv, o, favor ? std::optional<TensorView<const T>>(w.view()) : std::nullopt);
  const auto first = p.prefill(rows(q, 0, 70), rows(k, 0, 70), rows(v, 0, 70));
  for (int64_t t = 0; t < 70; ++t) expect_row(at(first, t), t, "prefill");
  for (int64_t t = 70; t < n; ++t) expect_row(p.step(at(q, t), at(k, t), at(v, t)), t, "step after prefill");
}

TEST(Recurrent, DecodingMatchesCausalAttention) {
  for (const char* map : {"elu", "relu", "given", "focused", "positive", "hyperbolic", "trig"}) {
    SCOPED_TRACE(map);
    const double sigma = std::string(map) == "trig" ? 0.5 : 1.0;
    check_decoding<double>(map, sigma);
    check_decoding<float>(map, sigma);
  }
}

// ‖q‖, ‖k‖ ≈ 30 in float32: the running log-scale keeps every step finite and accurate.
TEST(Recurrent, FavorStepsStayFiniteAtNorm30) {
  check_decoding<float>("positive", 30.0 / 4);  // d = 16: ‖x‖ ≈ 4σ = 30
  check_decoding<float>("hyperbolic", 30.0 / 4);
}

TEST(Recurrent, CopyRollsBack) {
  const int64_t B = 1, H = 2, n = 20, d = 8, dv = 4;
  const auto q = random_tensor<float>({B, H, n, d}, 1), k = random_tensor<float>({B, H, n, d}, 2),
             v = random_tensor<float>({B, H, n, dv}, 3), v2 = random_tensor<float>({B, H, n, dv}, 4);
  const auto w = random_features<float>(16, d);
  RecurrentOptions o;
  o.feature_map = "favor";
  RecurrentState<float> s(B, H, d, dv, o, w.view());
  s.prefill(rows(q, 0, 10), rows(k, 0, 10), rows(v, 0, 10));
  RecurrentState<float> saved = s.copy();
  std::vector<Tensor<float>> original;
  for (int64_t t = 10; t < n; ++t) original.push_back(s.step(at(q, t), at(k, t), at(v, t)));
  RecurrentState<float> other = saved.copy();
  for (int64_t t = 10; t < n; ++t) other.step(at(q, t), at(k, t), at(v2, t));  // a different branch
  for (int64_t t = 10; t < n; ++t) {
    const auto again = saved.step(at(q, t), at(k, t), at(v, t));
    for (int64_t i = 0; i < again.size(); ++i) ASSERT_EQ(again[i], original[t - 10][i]);
  }
  EXPECT_EQ(saved.tokens(), n);
}

TEST(Recurrent, BadArgumentsAreErrors) {
  const auto w = random_features<float>(16, 8);
  RecurrentOptions favor;
  favor.feature_map = "favor";
  EXPECT_THAT(error_of([&] { RecurrentState<float>(1, 2, 8, 4, favor); }), HasSubstr("needs a projection"));
  EXPECT_THAT(error_of([&] { RecurrentState<float>(1, 2, 7, 4, favor, w.view()); }),
              HasSubstr("projection has shape [16, 8]; expected [num_features >= 1, 7]"));
  RecurrentOptions negative = favor;
  negative.scale = -1;
  EXPECT_THAT(error_of([&] { RecurrentState<float>(1, 2, 8, 4, negative, w.view()); }),
              HasSubstr("recurrent_state: scale must be > 0 for random features"));
  RecurrentOptions bad_power;
  bad_power.feature_map = "focused";
  bad_power.focus_power = 0.5;
  EXPECT_THAT(error_of([&] { RecurrentState<float>(1, 2, 8, 4, bad_power); }),
              HasSubstr("recurrent_state: focus_power must be a number in [1, 1000], got 0.5"));
  RecurrentOptions elu;
  EXPECT_THAT(error_of([&] { RecurrentState<float>(1, 2, 8, 4, elu, w.view()); }),
              HasSubstr("projection is only used with feature_map=\"favor\""));
  elu.kernel = "trig";
  EXPECT_THAT(error_of([&] { RecurrentState<float>(1, 2, 8, 4, elu); }), HasSubstr("kernel is only used"));
  RecurrentOptions bad;
  bad.feature_map = "softmax";
  EXPECT_THAT(error_of([&] { RecurrentState<float>(1, 2, 8, 4, bad); }), HasSubstr("feature_map must be"));
  RecurrentState<float> s = recurrent_state<float>(1, 2, 8, 4);
  EXPECT_THAT(error_of([&] { s.step(random_tensor<float>({1, 2, 8}, 1), random_tensor<float>({1, 2, 8}, 2),
                                    random_tensor<float>({1, 2, 5}, 3)); }),
              HasSubstr("v_t has shape [1, 2, 5]; expected [1, 2, 4]"));
  EXPECT_THAT(error_of([&] { s.prefill(random_tensor<float>({1, 3, 5, 8}, 1), random_tensor<float>({1, 3, 5, 8}, 2),
                                       random_tensor<float>({1, 3, 5, 4}, 3)); }),
              HasSubstr("the state was made for 1, 2, 8, 4"));
  auto nan = random_tensor<float>({1, 2, 8}, 1);
  nan[3] = std::nanf("");
  EXPECT_THAT(error_of([&] { s.step(nan, nan, random_tensor<float>({1, 2, 4}, 3)); }),
              HasSubstr("q_t has a non-finite value"));
}

// A state used from two threads at once: one thread prefills long sequences while the other
// steps. Every call either runs whole or is refused with an Error naming the conflict; the
// token count is the sum of the calls that ran, so no call was half-applied.
TEST(Recurrent, TwoThreadsAtOnceAreRefusedNotInterleaved) {
  const int64_t B = 1, H = 4, d = 16, n = 4096;
  RecurrentState<float> state(B, H, d, d);
  const auto q = random_tensor<float>({B, H, n, d}, 1), k = random_tensor<float>({B, H, n, d}, 2),
             v = random_tensor<float>({B, H, n, d}, 3);
  const auto qt = random_tensor<float>({B, H, d}, 4);
  std::atomic<int64_t> ran{0}, refused{0};
  auto count = [&](auto call, int64_t tokens) {
    try {
      call();
      ran += tokens;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("in use by another thread"), std::string::npos) << e.what();
      ++refused;
    }
  };
  std::thread a([&] {
    for (int i = 0; i < 5; ++i) count([&] { state.prefill(q, k, v); }, n);
  });
  std::thread b([&] {
    for (int i = 0; i < 300; ++i) count([&] { state.step(qt, qt, qt); }, 1);
  });
  a.join();
  b.join();
  EXPECT_EQ(state.tokens(), ran.load());
  EXPECT_GT(ran.load(), 0);
}

}  // namespace
}  // namespace linattn
