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

// ---- Efficient Attention's state-level operations ----

// States [B,H,d,d_v+2] added as efficient.h says: c = max, [S | z] rescaled by exp(c_i − c).
template <class T>
Tensor<T> add_states(const Tensor<T>& a, const Tensor<T>& b) {
  Tensor<T> out(a.shape());
  const int64_t row = a.shape()[3];
  for (int64_t at = 0; at < a.size(); at += row) {
    const T ca = a[at + row - 1], cb = b[at + row - 1], c = std::max(ca, cb);
    const T fa = ca == -INFINITY ? T(0) : std::exp(ca - c), fb = cb == -INFINITY ? T(0) : std::exp(cb - c);
    for (int64_t i = 0; i + 1 < row; ++i) out[at + i] = a[at + i] * fa + b[at + i] * fb;
    out[at + row - 1] = c;
  }
  return out;
}

// Rows [begin, end) of x [B,H,n,c].
template <class T>
Tensor<T> rows_of(const Tensor<T>& x, int64_t begin, int64_t end) {
  const auto& sh = x.shape();
  Tensor<T> out({sh[0], sh[1], end - begin, sh[3]});
  for (int64_t bh = 0; bh < sh[0] * sh[1]; ++bh)
    for (int64_t j = begin; j < end; ++j)
      for (int64_t c = 0; c < sh[3]; ++c) out[(bh * (end - begin) + j - begin) * sh[3] + c] = x[(bh * sh[2] + j) * sh[3] + c];
  return out;
}

// The key lengths of rows [begin, end) of a sequence with lengths l.
std::vector<int64_t> local_lengths(const std::vector<int64_t>& l, int64_t begin, int64_t end) {
  std::vector<int64_t> out;
  for (int64_t x : l) out.push_back(std::clamp<int64_t>(x - begin, 0, end - begin));
  return out;
}

// The keys in three blocks (their states added, then applied to the queries) give
// efficient_attention: every mask (an item with no key at all included), at 1 and 3 threads
// (B·H = 4), float32 and float64. Bound against the float64 reference, per element:
// (n_k + d + 16)·u·max|v|: G_r is a weighted mean of v over the n_k keys (summation γ_{n_k},
// the exponentials, the merge's rescaling and the division, about 10u) and out a convex
// combination of the d rows of G (γ_d and the feature softmax's few u).
template <class T>
void check_efficient_states(int threads) {
  SCOPED_TRACE(::testing::Message() << "threads=" << threads << " T=" << sizeof(T));
  ScopedThreads scoped(threads);
  const int64_t B = 2, H = 2, nq = 11, n = 37, d = 5, dv = 3;
  const auto q = cast<T>(random_tensor<double>({B, H, nq, d}, 1, 2.0)), k = cast<T>(random_tensor<double>({B, H, n, d}, 2, 2.0)),
             v = cast<T>(random_tensor<double>({B, H, n, dv}, 3));
  for (const std::vector<int64_t>& lengths : {std::vector<int64_t>{n, n}, std::vector<int64_t>{20, 0}, std::vector<int64_t>{3, 14}}) {
    EfficientAttentionOptions o;
    o.key_lengths = lengths;
    const int64_t cuts[] = {0, 9, 16, n};
    Tensor<T> total;
    for (int i = 0; i < 3; ++i) {
      EfficientAttentionOptions ob;
      ob.key_lengths = local_lengths(lengths, cuts[i], cuts[i + 1]);
      Tensor<T> st = efficient_key_state<T>(rows_of(k, cuts[i], cuts[i + 1]), rows_of(v, cuts[i], cuts[i + 1]), ob);
      total = i == 0 ? std::move(st) : add_states(total, st);
    }
    const Tensor<T> out = efficient_apply_state<T>(q, total);
    const auto want = reference::efficient_attention(cast<double>(q), cast<double>(k), cast<double>(v), o);
    double v_max = 0;
    for (int64_t i = 0; i < v.size(); ++i) v_max = std::max(v_max, std::abs(static_cast<double>(v[i])));
    const double bound = static_cast<double>(n + d + 16) * unit_roundoff<T>() * v_max;
    for (int64_t i = 0; i < out.size(); ++i)
      ASSERT_NEAR(static_cast<double>(out[i]), want.value[i], bound) << "lengths " << lengths[0] << "," << lengths[1] << " at " << i;
  }
}

TEST(EfficientState, BlocksAddUpToEfficientAttention) {
  for (int threads : {1, 3}) {
    check_efficient_states<float>(threads);
    check_efficient_states<double>(threads);
  }
}

// Each operation's backward against central differences of its forward (float64). The key
// state's S and z are divided by exp(c) with c a function of k, which the gradient holds
// constant; the loss is therefore taken on the state at the base point's shifts c0,
// Σ dstate∘[S | z]·exp(c − c0), which is smooth in k and whose gradient at the base point is
// the backward's.
TEST(EfficientState, GradientsMatchCentralDifferences) {
  const int64_t B = 2, H = 2, nq = 6, n = 9, d = 4, dv = 3;
  auto q = random_tensor<double>({B, H, nq, d}, 1), k = random_tensor<double>({B, H, n, d}, 2),
       v = random_tensor<double>({B, H, n, dv}, 3);
  const auto dstate = random_tensor<double>({B, H, d, dv + 2}, 4), dout = random_tensor<double>({B, H, nq, dv}, 5);
  EfficientAttentionOptions o;
  o.key_lengths = std::vector<int64_t>{n, 6};
  o.scale = 0.7;
  const Tensor<double> base = efficient_key_state<double>(k, v, o);
  auto key_loss = [&] {
    const Tensor<double> st = efficient_key_state<double>(k, v, o);
    double sum = 0;
    for (int64_t at = 0; at < st.size(); at += dv + 2) {
      const double f = std::exp(st[at + dv + 1] - base[at + dv + 1]);
      for (int64_t c = 0; c <= dv; ++c) sum += dstate[at + c] * st[at + c] * f;
    }
    return sum;
  };
  const StateGrads<double> gk = efficient_key_state_backward<double>(k, v, base, dstate, o);
  expect_gradient(k, gk.dk, key_loss, "dk");
  expect_gradient(v, gk.dv, key_loss, "dv");
  Tensor<double> state = efficient_key_state<double>(k, v, o);
  EfficientAttentionOptions oq;
  oq.scale = 0.7;
  auto apply_loss = [&] { return dot_loss(efficient_apply_state<double>(q, state, oq), dout); };
  const StateGrads<double> ga = efficient_apply_state_backward<double>(q, state, dout, oq);
  expect_gradient(q, ga.dq, apply_loss, "dq");
  // The state's S and z; the shifts take no gradient: their column is 0, as the output's central
  // differences in them are (apply reads S/z alone).
  for (int64_t at = 0; at < state.size(); at += dv + 2) ASSERT_EQ(ga.dstate[at + dv + 1], 0.0);
  expect_gradient(state, ga.dstate, apply_loss, "dstate");
}

// Bitwise the same results at 1, 3 and 8 threads (B·H = 2: above and below it).
TEST(EfficientState, ThreadCountsGiveTheSameBits) {
  const auto q = random_tensor<float>({1, 2, 300, 8}, 1), k = random_tensor<float>({1, 2, 70, 8}, 2),
             v = random_tensor<float>({1, 2, 70, 4}, 3), dout = random_tensor<float>({1, 2, 300, 4}, 4);
  const auto dstate = random_tensor<float>({1, 2, 8, 6}, 5);
  std::optional<Tensor<float>> st1, out1, dq1, ds1, dk1, dv1;
  for (int threads : {1, 3, 8}) {
    ScopedThreads scoped(threads);
    Tensor<float> st = efficient_key_state<float>(k, v);
    Tensor<float> out = efficient_apply_state<float>(q, st);
    StateGrads<float> ga = efficient_apply_state_backward<float>(q, st, dout);
    StateGrads<float> gk = efficient_key_state_backward<float>(k, v, st, dstate);
    if (!st1) {
      st1 = std::move(st), out1 = std::move(out), dq1 = std::move(ga.dq), ds1 = std::move(ga.dstate);
      dk1 = std::move(gk.dk), dv1 = std::move(gk.dv);
      continue;
    }
    for (auto [got, want] :
         {std::pair{&st, &*st1}, {&out, &*out1}, {&ga.dq, &*dq1}, {&ga.dstate, &*ds1}, {&gk.dk, &*dk1}, {&gk.dv, &*dv1}})
      for (int64_t i = 0; i < got->size(); ++i) ASSERT_EQ((*got)[i], (*want)[i]) << threads << " threads, " << i;
  }
}

TEST(EfficientState, BadInputIsAnErrorNamingIt) {
  const auto q = random_tensor<float>({1, 2, 10, 4}, 1), k = random_tensor<float>({1, 2, 10, 4}, 2),
             v = random_tensor<float>({1, 2, 10, 3}, 3);
  const Tensor<float> st = efficient_key_state<float>(k, v);
  EfficientAttentionOptions o;
  o.causal = true;
  EXPECT_NE(error_of([&] { efficient_key_state<float>(k, v, o); }).find("future positions"), std::string::npos);
  EXPECT_NE(error_of([&] { efficient_apply_state<float>(q, st, o); }).find("future positions"), std::string::npos);
  o = {};
  o.key_lengths = std::vector<int64_t>{5};
  EXPECT_NE(error_of([&] { efficient_apply_state<float>(q, st, o); }).find("key_lengths is not taken here"),
            std::string::npos);
  auto k_bad = random_tensor<float>({1, 2, 10, 4}, 2);
  k_bad[7] = NAN;
  EXPECT_NE(error_of([&] { efficient_key_state<float>(k_bad, v); }).find("k has a non-finite value"), std::string::npos);
  const auto wrong = random_tensor<float>({1, 2, 3, 5}, 4);
  EXPECT_NE(error_of([&] { efficient_apply_state<float>(q, wrong); }).find("state has shape [1, 2, 3, 5]; expected [1, 2, 4, 5]"),
            std::string::npos);
  Tensor<float> bad_shift = efficient_key_state<float>(k, v);
  bad_shift[4] = NAN;  // row 0's shift
  EXPECT_NE(error_of([&] { efficient_apply_state<float>(q, bad_shift); }).find("state[4] = nan is a shift"),
            std::string::npos);
  Tensor<float> stale = efficient_key_state<float>(k, v);
  stale[4] = -INFINITY;  // row 0's shift, of a block with keys
  stale[0] = stale[1] = stale[2] = stale[3] = 0;
  const auto dstate = random_tensor<float>({1, 2, 4, 5}, 6);
  EXPECT_NE(error_of([&] { efficient_key_state_backward<float>(k, v, stale, dstate); })
                .find("state[4] = -inf is the shift of a block with keys"),
            std::string::npos);
  Tensor<float> no_key_sum = efficient_key_state<float>(k, v);
  no_key_sum[3] = 0;  // row 0's z, with S nonzero
  EXPECT_NE(error_of([&] { efficient_apply_state<float>(q, no_key_sum); }).find("in a row whose sum z is 0 (no key)"),
            std::string::npos);
  Tensor<float> negative_sum = efficient_key_state<float>(k, v);
  negative_sum[3] = -1;  // row 0's z
  EXPECT_NE(error_of([&] { efficient_apply_state<float>(q, negative_sum); }).find("expected >= 0"), std::string::npos);
}

// ---- Linformer's state-level operation ----

// Three blocks' projections (each key j of a block at column offset + j of e and f) add up to
// the whole sequence's, for shared and per-head e, f and every mask, at 1 and 3 threads,
// float32 and float64. Bound per element against float64 loops: (n + 3)·u·Σ_j |e_rj|·|k_jc|
// (γ_n for each block's sum, and the two additions of the blocks).
template <class T>
void check_linformer_blocks(bool per_head, int threads) {
  SCOPED_TRACE(::testing::Message() << "per_head=" << per_head << " threads=" << threads << " T=" << sizeof(T));
  ScopedThreads scoped(threads);
  const int64_t B = 2, H = 2, n = 37, n_max = 41, d = 5, dv = 3, sp = 6;
  const auto k = cast<T>(random_tensor<double>({B, H, n, d}, 2)), v = cast<T>(random_tensor<double>({B, H, n, dv}, 3));
  const Shape es = per_head ? Shape{H, sp, n_max} : Shape{sp, n_max};
  const auto e = cast<T>(random_tensor<double>(es, 4)), f = cast<T>(random_tensor<double>(es, 5));
  for (const std::vector<int64_t>& lengths : {std::vector<int64_t>{n, n}, std::vector<int64_t>{20, 0}}) {
    const int64_t cuts[] = {0, 9, 16, n};
    Tensor<T> total({B, H, sp, d + dv});
    for (int i = 0; i < 3; ++i) {
      LinformerOptions o;
      o.key_lengths = local_lengths(lengths, cuts[i], cuts[i + 1]);
      const Tensor<T> p = linformer_project<T>(rows_of(k, cuts[i], cuts[i + 1]), rows_of(v, cuts[i], cuts[i + 1]), e, f,
                                               cuts[i], o);
      for (int64_t x = 0; x < p.size(); ++x) total[x] += p[x];
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < sp; ++r)
          for (int64_t c = 0; c < d + dv; ++c) {
            const bool key = c < d;
            const Tensor<T>& m = key ? e : f;
            const Tensor<T>& x = key ? k : v;
            const int64_t w = key ? d : dv, col = key ? c : c - d;
            double want = 0, mag = 0;
            for (int64_t j = 0; j < lengths[b]; ++j) {
              const double t = static_cast<double>(m[(per_head ? h * sp * n_max : 0) + r * n_max + j]) *
                               static_cast<double>(x[((b * H + h) * n + j) * w + col]);
              want += t, mag += std::abs(t);
            }
            const double got = total[((b * H + h) * sp + r) * (d + dv) + c];
            ASSERT_NEAR(got, want, static_cast<double>(n + 3) * unit_roundoff<T>() * mag)
                << "b=" << b << " h=" << h << " r=" << r << " c=" << c;
          }
  }
}

TEST(LinformerProject, BlocksAddUpToTheWholeProjection) {
  for (bool per_head : {false, true})
    for (int threads : {1, 3}) {
      check_linformer_blocks<float>(per_head, threads);
      check_linformer_blocks<double>(per_head, threads);
    }
}

TEST(LinformerProject, GradientsMatchCentralDifferences) {
  for (bool per_head : {false, true}) {
    SCOPED_TRACE(per_head);
    const int64_t B = 2, H = 2, n = 7, n_max = 12, d = 3, dv = 2, sp = 4, offset = 3;
    auto k = random_tensor<double>({B, H, n, d}, 1), v = random_tensor<double>({B, H, n, dv}, 2);
    const Shape es = per_head ? Shape{H, sp, n_max} : Shape{sp, n_max};
    auto e = random_tensor<double>(es, 3), f = random_tensor<double>(es, 4);
    const auto G = random_tensor<double>({B, H, sp, d + dv}, 5);
    LinformerOptions o;
    o.key_lengths = std::vector<int64_t>{n, 4};
    auto loss = [&] { return dot_loss(linformer_project<double>(k, v, e, f, offset, o), G); };
    const auto g = linformer_project_backward<double>(k, v, e, f, G, offset, o);
    expect_gradient(k, g.dk, loss, "dk");
    expect_gradient(v, g.dv, loss, "dv");
    expect_gradient(e, g.params[0].second, loss, "de");
    expect_gradient(f, g.params[1].second, loss, "df");
    // Without the projections' gradients: none given, and dk, dv the same bits.
    const auto g0 = linformer_project_backward<double>(k, v, e, f, G, offset, o, false);
    EXPECT_TRUE(g0.params.empty());
    for (int64_t i = 0; i < g.dk.size(); ++i) ASSERT_EQ(g0.dk[i], g.dk[i]) << i;
    for (int64_t i = 0; i < g.dv.size(); ++i) ASSERT_EQ(g0.dv[i], g.dv[i]) << i;
  }
}

TEST(LinformerProject, BadInputIsAnErrorNamingIt) {
  const auto k = random_tensor<float>({1, 2, 10, 4}, 1), v = random_tensor<float>({1, 2, 10, 3}, 2);
  const auto e = random_tensor<float>({6, 16}, 3), f = random_tensor<float>({6, 16}, 4), f_bad = random_tensor<float>({6, 15}, 5);
  EXPECT_NE(error_of([&] { linformer_project<float>(k, v, e, f, 7); }).find("offset = 7 with n = 10 keys needs 0 <= offset <= n_max − n = 6"),
            std::string::npos);
  EXPECT_NE(error_of([&] { linformer_project<float>(k, v, e, f, -1); }).find("offset = -1"), std::string::npos);
  EXPECT_NE(error_of([&] { linformer_project<float>(k, v, e, f_bad); }).find("f has shape [6, 15]"), std::string::npos);
  LinformerOptions o;
  o.causal = true;
  EXPECT_NE(error_of([&] { linformer_project<float>(k, v, e, f, 0, o); }).find("future positions"), std::string::npos);
  const auto g_bad = random_tensor<float>({1, 2, 6, 6}, 6);
  EXPECT_NE(error_of([&] { linformer_project_backward<float>(k, v, e, f, g_bad); }).find("dprojected"), std::string::npos);
}

}  // namespace
}  // namespace linattn::testing
