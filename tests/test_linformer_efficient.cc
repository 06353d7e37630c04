// Linformer and Efficient Attention: fast paths against the tracked float64 references (bounds
// derived from the arithmetic, tracked_matrix.h), gradients against central differences, masks,
// the projection initialiser and errors.
#include <gtest/gtest.h>

#include "linattn/efficient.h"
#include "linattn/linformer.h"
#include "linattn/linformer/reference.h"
#include "linattn/efficient/reference.h"
#include "reference_bounds.h"
#include "test_util.h"

namespace linattn::testing {
namespace {

struct Case {
  int64_t B, H, nq, nk, d, dv;
  bool masked;
};

// n_q ≠ n_k, a single position, and sizes that cross the 256-row and 256-column blocks.
const Case kCases[] = {
    {2, 2, 13, 21, 8, 5, false}, {2, 2, 13, 21, 8, 5, true}, {1, 3, 300, 290, 16, 12, true},
    {2, 1, 1, 1, 4, 3, false},   {3, 2, 40, 7, 5, 9, true},
};

std::optional<std::vector<int64_t>> lengths_for(const Case& c) {
  if (!c.masked) return std::nullopt;
  std::vector<int64_t> l(static_cast<size_t>(c.B), c.nk);
  l.back() = c.nk / 2;  // may be 0: that item's output is 0
  return l;
}

template <class T>
void check_linformer(const Case& c, bool per_head, int64_t n_max, int threads) {
  SCOPED_TRACE(::testing::Message() << "nq=" << c.nq << " nk=" << c.nk << " n_max=" << n_max
                                    << " per_head=" << per_head << " masked=" << c.masked
                                    << " threads=" << threads << " T=" << sizeof(T));
  ScopedThreads scoped(threads);
  const int64_t s_proj = 6;
  auto [e, f] = linformer_projections<T>(s_proj, n_max, per_head ? c.H : 0, 7);
  const auto q = cast<T>(random_tensor<double>({c.B, c.H, c.nq, c.d}, 1)),
             k = cast<T>(random_tensor<double>({c.B, c.H, c.nk, c.d}, 2)),
             v = cast<T>(random_tensor<double>({c.B, c.H, c.nk, c.dv}, 3)),
             dout = cast<T>(random_tensor<double>({c.B, c.H, c.nq, c.dv}, 4));
  LinformerOptions o;
  o.key_lengths = lengths_for(c);
  const auto q64 = cast<double>(q), k64 = cast<double>(k), v64 = cast<double>(v),
             e64 = cast<double>(e), f64 = cast<double>(f), d64 = cast<double>(dout);
  const double u = unit_roundoff<T>(), u64 = unit_roundoff<double>();
  const auto ref = reference::linformer_attention(q64, k64, v64, e64, f64, o, u);
  const auto ref64 = reference::linformer_attention(q64, k64, v64, e64, f64, o, u64);
  expect_matches(linformer_attention<T>(q, k, v, e, f, o), ref, ref64, "out");
  expect_informative(ref, std::is_same_v<T, float> ? 1e-2 : 1e-10, "out");
  const auto g = linformer_attention_backward<T>(q, k, v, e, f, dout, o);
  const auto gr = reference::linformer_attention_backward(q64, k64, v64, e64, f64, d64, o, u);
  const auto gr64 = reference::linformer_attention_backward(q64, k64, v64, e64, f64, d64, o, u64);
  expect_matches(g.dq, gr[0], gr64[0], "dq");
  expect_matches(g.dk, gr[1], gr64[1], "dk");
  expect_matches(g.dv, gr[2], gr64[2], "dv");
  expect_matches(g.param("e"), gr[3], gr64[3], "de");
  expect_matches(g.param("f"), gr[4], gr64[4], "df");
}

TEST(LinformerVsReference, AllCases) {
  for (const Case& c : kCases)
    for (bool per_head : {false, true})
      for (int64_t extra : {0, 5}) {
        for (int threads : {1, 2}) check_linformer<float>(c, per_head, c.nk + extra, threads);
        check_linformer<double>(c, per_head, c.nk + extra, 2);
      }
}

TEST(LinformerGradient, MatchesCentralDifferences) {
  for (bool per_head : {false, true}) {
    SCOPED_TRACE(per_head ? "per head" : "shared");
    const int64_t B = 2, H = 2, nq = 7, nk = 9, d = 4, dv = 3, s_proj = 3;
    auto q = random_tensor<double>({B, H, nq, d}, 1), k = random_tensor<double>({B, H, nk, d}, 2),
         v = random_tensor<double>({B, H, nk, dv}, 3);
    auto [e, f] = linformer_projections<double>(s_proj, nk + 2, per_head ? H : 0, 4);
    const auto G = random_tensor<double>({B, H, nq, dv}, 5);
    LinformerOptions o;
    o.key_lengths = std::vector<int64_t>{nk, 6};
    auto loss = [&] { return dot_loss(linformer_attention<double>(q, k, v, e, f, o), G); };
    const auto g = linformer_attention_backward<double>(q, k, v, e, f, G, o);
    expect_gradient(q, g.dq, loss, "dq");
    expect_gradient(k, g.dk, loss, "dk");
    expect_gradient(v, g.dv, loss, "dv");
    expect_gradient(e, g.param("e"), loss, "de");
    expect_gradient(f, g.param("f"), loss, "df");
  }
}

TEST(LinformerMask, PaddedKeysAreIgnored) {
  const int64_t B = 2, H = 2, n = 20, d = 4, dv = 3, len = 11;
  auto q = random_tensor<double>({B, H, n, d}, 1), k = random_tensor<double>({B, H, n, d}, 2),
       v = random_tensor<double>({B, H, n, dv}, 3);
  const auto [e, f] = linformer_projections<double>(5, n, 0, 4);
  LinformerOptions o;
  o.key_lengths = std::vector<int64_t>{n, len};
  const auto out = linformer_attention<double>(q, k, v, e, f, o);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = len; j < n; ++j) {
      for (int64_t c = 0; c < d; ++c) k.view().row(H + h, j)[c] = NAN;
      for (int64_t c = 0; c < dv; ++c) v.view().row(H + h, j)[c] = NAN;
    }
  const auto out2 = linformer_attention<double>(q, k, v, e, f, o);
  for (int64_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], out2[i]) << i;
}

// Xavier-uniform with gain 1/√2: every value in (−a, a), a = sqrt(3/(n_max + s)); the sample
// variance within 5 standard errors of a²/3 (the variance of a sample variance of uniforms is
// (a⁴/5 − a⁴/9)/N); reproducible by seed.
TEST(LinformerProjections, DistributionShapeAndSeed) {
  const int64_t s = 32, n = 500;
  const auto [e, f] = linformer_projections<double>(s, n, 4, 9);
  ASSERT_EQ(e.shape(), (Shape{4, s, n}));
  const double a = std::sqrt(3.0 / double(n + s));
  for (const Tensor<double>* x : {&e, &f}) {
    double sum2 = 0;
    for (int64_t i = 0; i < x->size(); ++i) {
      ASSERT_LT(std::abs((*x)[i]), a);
      sum2 += (*x)[i] * (*x)[i];
    }
    const double N = double(x->size()), var = sum2 / N;
    const double se = std::sqrt((std::pow(a, 4) / 5 - std::pow(a, 4) / 9) / N);
    EXPECT_NEAR(var, a * a / 3, 5 * se);
  }
  const auto [e2, f2] = linformer_projections<double>(s, n, 4, 9);
  const auto [e3, f3] = linformer_projections<double>(s, n, 4, 10);
  for (int64_t i = 0; i < e.size(); ++i) ASSERT_EQ(e[i], e2[i]);
  EXPECT_NE(e[0], e3[0]);
  EXPECT_NE(e[0], f[0]);
  EXPECT_EQ(linformer_projections<float>(3, 8).first.shape(), (Shape{3, 8}));
}

TEST(LinformerErrors, OptionsAndShapesAreChecked) {
  const auto q = random_tensor<float>({1, 2, 10, 4}, 1), k = random_tensor<float>({1, 2, 10, 4}, 2),
             v = random_tensor<float>({1, 2, 10, 3}, 3);
  const auto [e, f] = linformer_projections<float>(4, 8);
  const auto [e3, f3] = linformer_projections<float>(4, 12, 3);
  const auto [e_ok, f_ok] = linformer_projections<float>(4, 12);
  auto err = [&](auto&& fn) { return error_of(fn); };
  EXPECT_NE(err([&] { linformer_attention<float>(q, k, v, e, f); })
                .find("n_k = 10 exceeds n_max = 8"),
            std::string::npos);
  EXPECT_NE(err([&] { linformer_attention<float>(q, k, v, e3, f3); }).find("must be heads = 2"),
            std::string::npos);
  EXPECT_NE(err([&] { linformer_attention<float>(q, k, v, e_ok, e3); }).find("expected the shape of e"),
            std::string::npos);
  LinformerOptions o;
  o.causal = true;
  EXPECT_NE(err([&] { linformer_attention<float>(q, k, v, e_ok, f_ok, o); }).find("future positions"),
            std::string::npos);
  auto bad = cast<float>(e_ok);
  bad[5] = INFINITY;
  EXPECT_NE(err([&] { linformer_attention<float>(q, k, v, bad, f_ok); })
                .find("e has a non-finite value at flat index 5"),
            std::string::npos);
  EXPECT_NE(err([&] { linformer_projections<float>(0, 8); }).find("s_proj must be >= 1"), std::string::npos);
}

template <class T>
void check_efficient(const Case& c, int threads) {
  SCOPED_TRACE(::testing::Message() << "nq=" << c.nq << " nk=" << c.nk << " masked=" << c.masked
                                    << " threads=" << threads << " T=" << sizeof(T));
  ScopedThreads scoped(threads);
  const auto q = cast<T>(random_tensor<double>({c.B, c.H, c.nq, c.d}, 1, 2.0)),
             k = cast<T>(random_tensor<double>({c.B, c.H, c.nk, c.d}, 2, 2.0)),
             v = cast<T>(random_tensor<double>({c.B, c.H, c.nk, c.dv}, 3)),
             dout = cast<T>(random_tensor<double>({c.B, c.H, c.nq, c.dv}, 4));
  EfficientAttentionOptions o;
  o.key_lengths = lengths_for(c);
  const auto q64 = cast<double>(q), k64 = cast<double>(k), v64 = cast<double>(v), d64 = cast<double>(dout);
  const double u = unit_roundoff<T>(), u64 = unit_roundoff<double>();
  const auto ref = reference::efficient_attention(q64, k64, v64, o, u);
  const auto ref64 = reference::efficient_attention(q64, k64, v64, o, u64);
  expect_matches(efficient_attention<T>(q, k, v, o), ref, ref64, "out");
  expect_informative(ref, std::is_same_v<T, float> ? 1e-2 : 1e-10, "out");
  const auto g = efficient_attention_backward<T>(q, k, v, dout, o);
  const auto gr = reference::efficient_attention_backward(q64, k64, v64, d64, o, u);
  const auto gr64 = reference::efficient_attention_backward(q64, k64, v64, d64, o, u64);
  expect_matches(g.dq, gr[0], gr64[0], "dq");
  expect_matches(g.dk, gr[1], gr64[1], "dk");
  expect_matches(g.dv, gr[2], gr64[2], "dv");
}

TEST(EfficientVsReference, AllCases) {
  for (const Case& c : kCases) {
    for (int threads : {1, 2}) check_efficient<float>(c, threads);
    check_efficient<double>(c, 2);
  }
}

TEST(EfficientGradient, MatchesCentralDifferences) {
  const int64_t B = 2, H = 2, nq = 7, nk = 9, d = 4, dv = 3;
  auto q = random_tensor<double>({B, H, nq, d}, 1), k = random_tensor<double>({B, H, nk, d}, 2),
       v = random_tensor<double>({B, H, nk, dv}, 3);
  const auto G = random_tensor<double>({B, H, nq, dv}, 5);
  EfficientAttentionOptions o;
  o.key_lengths = std::vector<int64_t>{nk, 6};
  o.scale = 0.7;
  auto loss = [&] { return dot_loss(efficient_attention<double>(q, k, v, o), G); };
  const auto g = efficient_attention_backward<double>(q, k, v, G, o);
  expect_gradient(q, g.dq, loss, "dq");
  expect_gradient(k, g.dk, loss, "dk");
  expect_gradient(v, g.dv, loss, "dv");
}

TEST(EfficientMask, PaddedKeysAreIgnoredAndEmptyItemsAreZero) {
  const int64_t B = 2, H = 1, n = 12, d = 4, dv = 3, len = 5;
  auto q = random_tensor<double>({B, H, n, d}, 1), k = random_tensor<double>({B, H, n, d}, 2),
       v = random_tensor<double>({B, H, n, dv}, 3);
  EfficientAttentionOptions o;
  o.key_lengths = std::vector<int64_t>{n, len};
  const auto out = efficient_attention<double>(q, k, v, o);
  for (int64_t j = len; j < n; ++j) {
    for (int64_t c = 0; c < d; ++c) k.view().row(1, j)[c] = NAN;
    for (int64_t c = 0; c < dv; ++c) v.view().row(1, j)[c] = NAN;
  }
  const auto out2 = efficient_attention<double>(q, k, v, o);
  for (int64_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], out2[i]) << i;
  o.key_lengths = std::vector<int64_t>{n, 0};
  const auto out3 = efficient_attention<double>(q, k, v, o);
  for (int64_t i = n * dv; i < out3.size(); ++i) ASSERT_EQ(out3[i], 0.0);
  // The backward writes its gradients in full (they are not zeroed first): padded keys' rows
  // are 0, and an item without keys gets 0 everywhere; at thread counts below and above B·H.
  const auto dout = random_tensor<double>({B, H, n, dv}, 4);
  for (const int threads : {1, 3}) {
    testing::ScopedThreads scope(threads);
    o.key_lengths = std::vector<int64_t>{n, len};
    const auto g = efficient_attention_backward<double>(q, k, v, dout, o);
    for (int64_t j = len; j < n; ++j) {
      for (int64_t c = 0; c < d; ++c) ASSERT_EQ(g.dk.view().row(1, j)[c], 0.0) << j;
      for (int64_t c = 0; c < dv; ++c) ASSERT_EQ(g.dv.view().row(1, j)[c], 0.0) << j;
    }
    for (const Tensor<double>* t : {&g.dq, &g.dk, &g.dv})
      for (int64_t i = 0; i < t->size(); ++i) ASSERT_TRUE(std::isfinite((*t)[i])) << i;
    o.key_lengths = std::vector<int64_t>{n, 0};
    const auto g0 = efficient_attention_backward<double>(q, k, v, dout, o);
    for (int64_t i = n * d; i < g0.dq.size(); ++i) ASSERT_EQ(g0.dq[i], 0.0) << i;
    for (int64_t i = n * d; i < g0.dk.size(); ++i) ASSERT_EQ(g0.dk[i], 0.0) << i;
    for (int64_t i = n * dv; i < g0.dv.size(); ++i) ASSERT_EQ(g0.dv[i], 0.0) << i;
  }
}

// The backward checks its gradients for overflow while it writes them (not in a second pass):
// v and dout all 2^63, just under the 2^64 where they would be rescaled, make G = ρ_kᵀV = 2^63
// and dρ_q = dout·Gᵀ = d_v·2^126 = 2^128, past float32's range.
TEST(EfficientBackward, GradientOverflowIsAnError) {
  const auto q = random_tensor<float>({2, 3, 40, 8}, 1), k = random_tensor<float>({2, 3, 40, 8}, 2);
  Tensor<float> v({2, 3, 40, 4}), g({2, 3, 40, 4});
  for (Tensor<float>* t : {&v, &g})
    for (int64_t i = 0; i < t->size(); ++i) (*t)[i] = std::ldexp(1.0f, 63);
  for (const int threads : {1, 2, 5, 16}) {
    testing::ScopedThreads scope(threads);
    EXPECT_NE(error_of([&] { efficient_attention_backward<float>(q, k, v, g); }).find("overflows float32"),
              std::string::npos)
        << threads << " threads";
  }
}

TEST(EfficientErrors, CausalAndShapes) {
  const auto q = random_tensor<float>({1, 2, 10, 4}, 1), k = random_tensor<float>({1, 2, 10, 4}, 2),
             v = random_tensor<float>({1, 2, 10, 3}, 3), v_bad = random_tensor<float>({1, 2, 9, 3}, 4);
  EfficientAttentionOptions o;
  o.causal = true;
  EXPECT_NE(error_of([&] { efficient_attention<float>(q, k, v, o); }).find("future positions"),
            std::string::npos);
  EXPECT_NE(error_of([&] { efficient_attention<float>(q, k, v_bad); }).find("v has shape [1, 2, 9, 3]"),
            std::string::npos);
  o = {};
  o.scale = NAN;
  EXPECT_NE(error_of([&] { efficient_attention<float>(q, k, v, o); }).find("scale must be finite"),
            std::string::npos);
}

}  // namespace
}  // namespace linattn::testing
