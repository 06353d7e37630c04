// hybrid_attention (sliding window + linear): both fast paths (blocked and sweeps) against the float64 reference at a
// derived rounding bound, for every mask, window size, feature map and thread count; every
// gradient of the reference against central differences; window 0 against linear_attention;
// FAVOR's features: window 0 against favor_attention, a whole window against softmax_attention;
// any finite logit; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "linattn/hybrid.h"
#include "linattn/hybrid/reference.h"
#include "linattn/kernelized/reference.h"
#include "linattn/kernelized.h"
#include "linattn/softmax.h"
#include "hedgehog_bounds.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::cast;
using testing::random_tensor;

constexpr int64_t Inputs_dv = 4;

struct Case {
  bool causal;
  int64_t window;
  std::string map;  // "elu", "relu", "focused", "given", "favor" (positive), "favor-hyperbolic"
  bool gate;
  bool lengths;
  int64_t n_q, n_k;
  int64_t sinks = 0;  // causal only
  bool decay = false;  // causal only: log_decay per head
  int64_t value_dim = Inputs_dv;  // a multiple of 16 takes float32's tile kernels on the blocked path
};

std::string name(const Case& c) {
  return std::string(c.causal ? "causal" : "full") + " w=" + std::to_string(c.window) + " " + c.map +
         (c.gate ? " gate" : "") + (c.lengths ? " key_lengths" : "") + " n_q=" + std::to_string(c.n_q) +
         " n_k=" + std::to_string(c.n_k) + (c.sinks ? " sinks=" + std::to_string(c.sinks) : "") +
         (c.decay ? " decay" : "") + (c.value_dim != Inputs_dv ? " dv=" + std::to_string(c.value_dim) : "");
}

// Inputs of one case, in double (the reference's) with float copies.
struct Inputs {
  static constexpr int64_t B = 2, H = 3, d = 5, dv = Inputs_dv, m = 6, num_features = 4;
  Tensor<double> q, k, v, dout, fq, fk, gate, projection, log_decay;
  HybridAttentionOptions opts;
  bool given, gated, favor, decayed;

  Inputs(const Case& c, uint64_t seed, double q_sigma = 1.0)
      : q(random_tensor<double>({B, H, c.n_q, d}, seed, q_sigma)),
        k(random_tensor<double>({B, H, c.n_k, d}, seed + 1, q_sigma)),
        v(random_tensor<double>({B, H, c.n_k, c.value_dim}, seed + 2)),
        dout(random_tensor<double>({B, H, c.n_q, c.value_dim}, seed + 3)),
        fq(random_tensor<double>({B, H, c.n_q, m}, seed + 4)),
        fk(random_tensor<double>({B, H, c.n_k, m}, seed + 5)),
        gate(random_tensor<double>({H}, seed + 6)),
        projection(random_tensor<double>({num_features, d}, seed + 7)),
        log_decay(Shape{H}),
        given(c.map == "given"),
        gated(c.gate),
        favor(c.map.rfind("favor", 0) == 0), decayed(c.decay) {
    for (int64_t h = 0; h < H; ++h) log_decay[h] = -0.05 * static_cast<double>(h * h) - 0.01;  // 0.01 .. 0.21 a step
    for (Tensor<double>* f : {&fq, &fk})  // non-negative features
      for (int64_t i = 0; i < f->size(); ++i) (*f)[i] = std::abs((*f)[i]);
    opts.causal = c.causal;
    opts.window = c.window;
    opts.sinks = c.sinks;
    opts.feature_map = favor ? "favor" : c.map;
    if (c.map == "favor-hyperbolic") opts.kernel = "hyperbolic";
    if (c.lengths) opts.key_lengths = std::vector<int64_t>{c.n_k, std::max<int64_t>(c.n_k - 7, 0)};
  }
  template <class T>
  HybridInputs<T> inputs(const Tensor<T>& fq_t, const Tensor<T>& fk_t, const Tensor<T>& gate_t,
                         const Tensor<T>& projection_t, const Tensor<T>& decay_t) const {
    HybridInputs<T> in;
    if (decayed) in.log_decay = decay_t.view();
    if (given) in.query_features = fq_t.view(), in.key_features = fk_t.view();
    if (gated) in.window_gate = gate_t.view();
    if (favor) in.projection = projection_t.view();
    return in;
  }
  HybridInputs<double> inputs() const { return inputs<double>(fq, fk, gate, projection, log_decay); }
  template <class T>
  void round_to() {
    for (Tensor<double>* t : {&q, &k, &v, &dout, &fq, &fk, &gate, &projection, &log_decay})
      for (int64_t i = 0; i < t->size(); ++i) (*t)[i] = static_cast<double>(static_cast<T>((*t)[i]));
  }
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool causal : {false, true})
    for (int64_t w : {0, 1, 3, 8})
      for (const char* map : {"elu", "relu", "given"}) {
        out.push_back({causal, w, map, w % 2 == 1, false, 23, 23});
        out.push_back({causal, w, map, true, true, 17, 30});  // n_q < n_k: bottom-right aligned
      }
  for (bool causal : {false, true})  // FAVOR's two kernels, every window, with and without masks
    for (int64_t w : {0, 1, 3, 8})
      for (const char* map : {"favor", "favor-hyperbolic"}) {
        out.push_back({causal, w, map, w % 2 == 1, false, 23, 23});
        out.push_back({causal, w, map, true, true, 17, 30});
      }
  out.push_back({true, 4, "favor", true, true, 30, 17});
  out.push_back({true, 4, "elu", true, true, 30, 17});  // causal n_q > n_k: early rows see nothing
  out.push_back({false, 100, "given", true, false, 19, 19});  // the window covers everything
  // Attention sinks: fewer, as many and more than the window, with masks, n_q < n_k and > n_k.
  for (int64_t sinks : {1, 4, 30})
    for (int64_t w : {0, 1, 3})
      for (const char* map : {"elu", "given", "favor"}) {
        out.push_back({true, w, map, w == 1, false, 23, 23, sinks});
        out.push_back({true, w, map, true, true, 17, 30, sinks});
      }
  out.push_back({true, 2, "relu", true, true, 30, 17, 3});
  // The linear part decayed (log_decay), with and without sinks, every map.
  for (const char* map : {"elu", "relu", "given", "favor", "favor-hyperbolic"})
    for (int64_t w : {0, 3}) {
      out.push_back({true, w, map, w > 0, false, 23, 23, 0, true});
      out.push_back({true, w, map, true, true, 17, 30, w > 0 ? 2 : 0, true});
    }
  // Causal with n_q = n_k and features used as they are runs on the blocked path (tiles of 64
  // queries, the linear part on the chunked gated engine): sequences of several tiles, windows
  // inside a tile, at its size, across tiles and past the sequence, sinks reached by the window
  // or not, with masks, gate and decay.
  for (int64_t w : {0, 1, 63, 64, 65, 140, 200})
    for (const char* map : {"elu", "given"}) {
      out.push_back({true, w, map, true, w % 2 == 1, 150, 150});
      out.push_back({true, w, map, w % 2 == 0, true, 150, 150, w == 0 ? 3 : 5, true});
    }
  for (int64_t sinks : {70, 160}) out.push_back({true, 64, "given", true, true, 150, 150, sinks, true});
  out.push_back({true, 70, "relu", true, true, 150, 150, 2, true});
  // The focused map (through the library's FeatureMap), on both paths.
  for (int64_t w : {0, 3}) {
    out.push_back({false, w, "focused", true, true, 17, 30});
    out.push_back({true, w, "focused", w == 3, false, 23, 23, 2, w == 3});
  }
  out.push_back({true, 65, "focused", true, true, 150, 150, 4, true});
  // Values of 16 and 32 columns: float32's window products on the tile kernels.
  for (int64_t dv : {16, 32}) {
    out.push_back({true, 64, "elu", true, true, 150, 150, 5, true, dv});
    out.push_back({true, 3, "given", false, false, 129, 129, 0, false, dv});
  }
  out.push_back({true, 20, "elu", false, false, 129, 129});
  return out;
}

// The first-order rounding bound of a fast result: ε·(the result's magnitude), where the
// magnitude is the reference computed on absolute values with differences turned into sums
// (reference.h), and ε = K·(2·γ_{d+1}·|scale|·max Σ_t|q_t k_t| + γ_{n_k+m'+d+d_v+16}): each
// weight's relative error is at most the score's error 2·γ_{d+1}·|s|-magnitude (through exp and
// the row max) or γ_{m'+2} (a feature product), the exp and the maps add a few units of
// roundoff, every sum of non-negative terms at most γ_{n_k+m'} relative; K = 6 bounds how many
// rounded factors any term of a gradient multiplies (weight, g_i or c_i, v, feature, slope).
// FAVOR adds 2·γ_{d+4}·(A + A_q + A_k): each logit L = √scale·ω·x − scale·‖x‖²/2 is off by at
// most γ_{d+3}·A_x (A_x = max over rows and features of √scale·Σ|ω_t x_t| + scale·Σx_t²/2), and
// every shift (L + peak − R, s − R) rounds once more, relative to |s| + |L_q| + |L_k|; an error δ
// in an exponent is a relative error δ in the weight.
template <class T>
double epsilon(const Inputs& x, const Case& c, double scale) {
  double A = 0;
  for (int64_t bh = 0; bh < Inputs::B * Inputs::H; ++bh)
    for (int64_t i = 0; i < c.n_q; ++i)
      for (int64_t j = 0; j < c.n_k; ++j) {
        double s = 0;
        for (int64_t t = 0; t < Inputs::d; ++t) s += std::abs(x.q.view().row(bh, i)[t] * x.k.view().row(bh, j)[t]);
        A = std::max(A, std::abs(scale) * s);
      }
  const double n = static_cast<double>(c.n_k + Inputs::m + Inputs::d + c.value_dim + 16);
  double eps = 6 * (2 * testing::gamma<T>(Inputs::d + 1) * A + testing::gamma<T>(n));
  if (x.favor) {
    auto logit_size = [&](const Tensor<double>& rows) {
      double top = 0;
      for (int64_t r = 0; r < rows.size() / Inputs::d; ++r) {
        const double* xr = rows.data() + r * Inputs::d;
        double h = 0;
        for (int64_t t = 0; t < Inputs::d; ++t) h += scale * xr[t] * xr[t] / 2;
        for (int64_t f = 0; f < Inputs::num_features; ++f) {
          double u = 0;
          for (int64_t t = 0; t < Inputs::d; ++t) u += std::sqrt(scale) * std::abs(x.projection[f * Inputs::d + t] * xr[t]);
          top = std::max(top, u + h);
        }
      }
      return top;
    };
    eps += 6 * 2 * testing::gamma<T>(Inputs::d + 4) * (A + logit_size(x.q) + logit_size(x.k));
  }
  return eps;
}

Tensor<double> bound_of(const Tensor<double>& magnitude, double eps) {
  Tensor<double> b(magnitude.shape());
  for (int64_t i = 0; i < b.size(); ++i) b[i] = eps * magnitude[i] + 1e-300;
  return b;
}

class HybridVsReference : public ::testing::TestWithParam<int> {};

template <class T>
void compare(const Case& c, int threads) {
  SCOPED_TRACE(name(c) + " " + std::to_string(threads) + " threads");
  testing::ScopedThreads scope(threads);
  Inputs x(c, 100 + static_cast<uint64_t>(c.window) * 7 + c.n_q);
  x.round_to<T>();  // the T inputs are exactly the reference's
  const Tensor<T> q = cast<T>(x.q), k = cast<T>(x.k), v = cast<T>(x.v), dout = cast<T>(x.dout), fq = cast<T>(x.fq),
                  fk = cast<T>(x.fk), gate = cast<T>(x.gate), projection = cast<T>(x.projection),
                  log_decay = cast<T>(x.log_decay);
  const auto in_y = x.inputs();
  const Tensor<double> want_t = reference::hybrid_attention(x.q, x.k, x.v, in_y, x.opts);
  const Tensor<double> mag = reference::hybrid_attention(x.q, x.k, x.v, in_y, x.opts, true);
  const AttentionGrads<double> gwant_t = reference::hybrid_attention_backward(x.q, x.k, x.v, x.dout, in_y, x.opts);
  const AttentionGrads<double> gmag = reference::hybrid_attention_backward(x.q, x.k, x.v, x.dout, in_y, x.opts, true);
  const double eps = epsilon<T>(x, c, 1 / std::sqrt(static_cast<double>(Inputs::d)));
  const auto in = x.inputs<T>(fq, fk, gate, projection, log_decay);
  testing::expect_within(hybrid_attention<T>(q, k, v, in, x.opts), want_t, bound_of(mag, eps), "out");
  const AttentionGrads<T> g = hybrid_attention_backward<T>(q, k, v, dout, in, x.opts);
  testing::expect_within(g.dq, gwant_t.dq, bound_of(gmag.dq, eps), "dq");
  testing::expect_within(g.dk, gwant_t.dk, bound_of(gmag.dk, eps), "dk");
  testing::expect_within(g.dv, gwant_t.dv, bound_of(gmag.dv, eps), "dv");
  ASSERT_EQ(g.params.size(), gwant_t.params.size());
  for (size_t i = 0; i < g.params.size(); ++i) {
    ASSERT_EQ(g.params[i].first, gwant_t.params[i].first);
    testing::expect_within(g.params[i].second, gwant_t.params[i].second, bound_of(gmag.params[i].second, eps),
                           ("d" + g.params[i].first).c_str());
  }
}

TEST_P(HybridVsReference, EveryMaskWindowAndMap) {
  for (const Case& c : cases()) {
    compare<float>(c, GetParam());
    compare<double>(c, GetParam());
  }
}

// Threads below and above batch·heads = 6.
INSTANTIATE_TEST_SUITE_P(Threads, HybridVsReference, ::testing::Values(1, 3, 8, 16));

// The forward and every gradient (the window gate's included) at 3, 8 and 16 threads, bitwise
// those of one thread.
void expect_same_at_any_threads(const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v,
                                const Tensor<float>& dout, const HybridInputs<float>& in,
                                const HybridAttentionOptions& o) {
  auto run = [&](int threads) {
    testing::ScopedThreads scope(threads);
    return std::make_pair(hybrid_attention<float>(q, k, v, in, o), hybrid_attention_backward<float>(q, k, v, dout, in, o));
  };
  const auto one = run(1);
  for (int threads : {3, 8, 16}) {
    const auto many = run(threads);
    for (const auto& [got, want] : {std::pair{&many.first, &one.first}, std::pair{&many.second.dq, &one.second.dq},
                                    std::pair{&many.second.dk, &one.second.dk}, std::pair{&many.second.dv, &one.second.dv},
                                    std::pair{&many.second.param("window_gate"), &one.second.param("window_gate")}})
      for (int64_t i = 0; i < want->size(); ++i) ASSERT_EQ((*got)[i], (*want)[i]) << threads << " threads, " << i;
  }
}

// FAVOR's features with batch·heads of 1 and 2, below every thread count tried: the results are
// bitwise those of one thread (items are independent; nothing depends on the split).
TEST(Hybrid, FavorFewItemsAnyThreads) {
  for (int64_t heads : {1, 2})
    for (bool causal : {false, true}) {
      SCOPED_TRACE(std::to_string(heads) + (causal ? " causal" : ""));
      const Tensor<float> q = random_tensor<float>({1, heads, 37, 5}, 11), k = random_tensor<float>({1, heads, 37, 5}, 12),
                          v = random_tensor<float>({1, heads, 37, 4}, 13), dout = random_tensor<float>({1, heads, 37, 4}, 14),
                          gate = random_tensor<float>({heads}, 15), projection = random_tensor<float>({8, 5}, 16);
      HybridAttentionOptions o;
      o.causal = causal;
      o.window = 3;
      o.feature_map = "favor";
      o.kernel = "hyperbolic";
      HybridInputs<float> in;
      in.window_gate = gate.view();
      in.projection = projection.view();
      expect_same_at_any_threads(q, k, v, dout, in, o);
    }
}

// The blocked path (causal, n_q = n_k, a plain map) over several tiles, with batch·heads of 1 and
// 2: bitwise the results of one thread at 3, 8 and 16 (tasks are items; nothing depends on the
// split).
TEST(Hybrid, BlockedPathAnyThreads) {
  for (int64_t heads : {1, 2}) {
    SCOPED_TRACE(std::to_string(heads) + " heads");
    const Tensor<float> q = random_tensor<float>({1, heads, 150, 8}, 21), k = random_tensor<float>({1, heads, 150, 8}, 22),
                        v = random_tensor<float>({1, heads, 150, 16}, 23), dout = random_tensor<float>({1, heads, 150, 16}, 24),
                        gate = random_tensor<float>({heads}, 25);
    Tensor<float> decay({heads});
    for (int64_t h = 0; h < heads; ++h) decay[h] = -0.01f * static_cast<float>(h + 1);
    HybridAttentionOptions o;
    o.causal = true;
    o.window = 40;
    o.sinks = 3;
    o.feature_map = "focused";
    HybridInputs<float> in;
    in.window_gate = gate.view();
    in.log_decay = decay.view();
    expect_same_at_any_threads(q, k, v, dout, in, o);
  }
}

// The reference's backward (which the fast path is compared with above) against central
// differences of the reference's forward, for every input with a gradient.
TEST(HybridGradients, ReferenceMatchesFiniteDifferences) {
  for (const Case& c : {Case{true, 3, "elu", true, true, 9, 11}, Case{false, 2, "relu", true, true, 10, 10},
                        Case{false, 2, "given", true, true, 8, 12}, Case{true, 4, "given", true, false, 9, 9},
                        Case{true, 3, "favor", true, true, 9, 11}, Case{false, 2, "favor-hyperbolic", true, true, 10, 10},
                        Case{false, 1, "favor", false, false, 8, 12}, Case{true, 2, "elu", true, true, 9, 11, 3},
                        Case{true, 0, "given", true, false, 9, 9, 2}, Case{true, 3, "favor", true, true, 9, 11, 2},
                        Case{true, 2, "elu", true, true, 9, 11, 2, true}, Case{true, 1, "favor", false, false, 9, 9, 0, true},
                        Case{true, 0, "given", true, true, 9, 11, 0, true}, Case{true, 3, "focused", true, true, 9, 9, 2, true},
                        Case{false, 2, "focused", true, false, 8, 12}}) {
    SCOPED_TRACE(name(c));
    Inputs x(c, 7);
    const Tensor<double> G = random_tensor<double>({Inputs::B, Inputs::H, c.n_q, Inputs::dv}, 99);
    // relu's kink (focused's too): keep q and k away from 0 so that h = 1e-5 never crosses it.
    if (c.map == "relu" || c.map == "focused")
      for (Tensor<double>* t : {&x.q, &x.k})
        for (int64_t i = 0; i < t->size(); ++i) (*t)[i] += ((*t)[i] >= 0 ? 0.1 : -0.1);
    const AttentionGrads<double> g = reference::hybrid_attention_backward(x.q, x.k, x.v, G, x.inputs(), x.opts);
    auto loss = [&] { return testing::dot_loss(reference::hybrid_attention(x.q, x.k, x.v, x.inputs(), x.opts), G); };
    testing::expect_gradient(x.q, g.dq, loss, "q");
    testing::expect_gradient(x.k, g.dk, loss, "k");
    testing::expect_gradient(x.v, g.dv, loss, "v");
    if (x.given) {
      testing::expect_gradient(x.fq, g.param("query_features"), loss, "query_features");
      testing::expect_gradient(x.fk, g.param("key_features"), loss, "key_features");
    }
    if (x.gated) testing::expect_gradient(x.gate, g.param("window_gate"), loss, "window_gate");
  }
}

// window = 0 is plain linear attention: the same as linear_attention with the same map (elu,
// relu, or the given features through feature_map="given").
TEST(Hybrid, WindowZeroIsLinearAttention) {
  for (bool causal : {false, true})
    for (const char* map : {"elu", "relu", "given"}) {
      SCOPED_TRACE(std::string(map) + (causal ? " causal" : ""));
      const Case c{causal, 0, map, false, true, 21, 21};
      const Inputs x(c, 3);
      LinearAttentionOptions lo;
      lo.causal = causal;
      lo.key_lengths = x.opts.key_lengths;
      lo.feature_map = map;
      const bool given = std::string(map) == "given";
      const Tensor<double> lin = linear_attention<double>(given ? x.fq.view() : x.q.view(),
                                                          given ? x.fk.view() : x.k.view(), x.v, lo);
      const Tensor<double> hyb = hybrid_attention<double>(x.q, x.k, x.v, x.inputs(), x.opts);
      ASSERT_EQ(lin.shape(), hyb.shape());
      for (int64_t i = 0; i < lin.size(); ++i) EXPECT_NEAR(hyb[i], lin[i], 1e-12 * (1 + std::abs(lin[i]))) << i;
    }
}

// Scores of ±1e4 (far beyond exp's range unshifted): the window is shifted by its row maximum
// (FAVOR: every term by the row's largest), so the output is finite and, in float64, matches the
// reference at the derived bound.
TEST(Hybrid, AnyFiniteLogitIsSafe) {
  for (const char* map : {"given", "favor", "favor-hyperbolic"})
    for (bool causal : {false, true}) {
      SCOPED_TRACE(std::string(map) + (causal ? " causal" : ""));
      const Case c{causal, 3, map, true, true, 15, 15};
      Inputs x(c, 5, 60.0);
      x.round_to<float>();
      const auto in_y = x.inputs();
      const Tensor<double> want = reference::hybrid_attention(x.q, x.k, x.v, in_y, x.opts);
      const Tensor<float> q = cast<float>(x.q), k = cast<float>(x.k), v = cast<float>(x.v), fq = cast<float>(x.fq),
                          fk = cast<float>(x.fk), gate = cast<float>(x.gate), projection = cast<float>(x.projection),
                          decay = cast<float>(x.log_decay);
      const auto in = x.inputs<float>(fq, fk, gate, projection, decay);
      const Tensor<float> got = hybrid_attention<float>(q, k, v, in, x.opts);
      for (int64_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i])) << i;
        ASSERT_TRUE(std::isfinite(want[i])) << i;
      }
      const AttentionGrads<float> g = hybrid_attention_backward<float>(q, k, v, cast<float>(x.dout), in, x.opts);
      for (const Tensor<float>* t : {&g.dq, &g.dk, &g.dv})
        for (int64_t i = 0; i < t->size(); ++i) ASSERT_TRUE(std::isfinite((*t)[i])) << i;
      const double eps = epsilon<double>(x, c, 1 / std::sqrt(static_cast<double>(Inputs::d)));
      testing::expect_within(hybrid_attention<double>(x.q, x.k, x.v, in_y, x.opts), want,
                             bound_of(reference::hybrid_attention(x.q, x.k, x.v, in_y, x.opts, true), eps), "out");
    }
}

// FAVOR with every logit far below exp's range (q > 0 > k elementwise, scores near −5000, and
// FAVOR's L_q + L_k <= s + ‖ω‖²/2 as low): the row shifts keep
// the output finite and equal to the reference, with eps = 0 (e^{−R_i} overflows, but eps·e^{−R_i}
// is taken as 0, never 0·inf) and with the default eps (the row is then 0, as its formula says).
TEST(Hybrid, FavorFarBelowExpRange) {
  for (double eps : {0.0, 1e-6}) {
    SCOPED_TRACE(eps);
    Inputs x(Case{false, 2, "favor", true, false, 12, 12}, 9, 60.0);
    for (int64_t i = 0; i < x.k.size(); ++i) x.q[i] = std::abs(x.q[i]), x.k[i] = -std::abs(x.k[i]);
    x.opts.eps = eps;
    const auto in = x.inputs();
    const Tensor<double> want = reference::hybrid_attention(x.q, x.k, x.v, in, x.opts);
    const Tensor<double> got = hybrid_attention<double>(x.q, x.k, x.v, in, x.opts);
    double top = 0;
    for (int64_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i]) && std::isfinite(want[i])) << i;
      top = std::max(top, std::abs(want[i]));
    }
    EXPECT_EQ(top > 0, eps == 0);  // eps = 0: the estimator's ratio; eps > 0: swamped, 0
    const double bound_eps = epsilon<double>(x, Case{false, 2, "favor", true, false, 12, 12},
                                             1 / std::sqrt(static_cast<double>(Inputs::d)));
    testing::expect_within(got, want, bound_of(reference::hybrid_attention(x.q, x.k, x.v, in, x.opts, true), bound_eps),
                           "out");
  }
}

// With FAVOR's features the hybrid is the estimator of softmax with exact weights inside the
// window: window 0 is favor_attention (eps = 0: FAVOR has none), and a window over every key
// is softmax_attention exactly, whatever the projection.
TEST(Hybrid, FavorEndsAreFavorAndSoftmax) {
  for (const char* map : {"favor", "favor-hyperbolic"})
    for (bool causal : {false, true}) {
      SCOPED_TRACE(std::string(map) + (causal ? " causal" : ""));
      Inputs x(Case{causal, 0, map, false, true, 21, 21}, 3);
      x.opts.eps = 0;
      FavorOptions fo;
      fo.causal = causal;
      fo.key_lengths = x.opts.key_lengths;
      fo.kernel = x.opts.kernel;
      const Tensor<double> favor = favor_attention<double>(x.q, x.k, x.v, x.projection, fo);
      const Tensor<double> zero = hybrid_attention<double>(x.q, x.k, x.v, x.inputs(), x.opts);
      ASSERT_EQ(favor.shape(), zero.shape());
      for (int64_t i = 0; i < favor.size(); ++i) EXPECT_NEAR(zero[i], favor[i], 1e-12 * (1 + std::abs(favor[i]))) << i;
      x.opts.window = 100;
      const Tensor<double> soft = softmax_attention<double>(x.q, x.k, x.v, fo).out;
      const Tensor<double> whole = hybrid_attention<double>(x.q, x.k, x.v, x.inputs(), x.opts);
      for (int64_t i = 0; i < soft.size(); ++i) EXPECT_NEAR(whole[i], soft[i], 1e-12 * (1 + std::abs(soft[i]))) << i;
    }
}

// Sinks that cover every key make the causal hybrid exact softmax attention (γ = 1): the linear
// part holds nothing; and with window 0 and one sink, the first key is exact for every row.
TEST(Hybrid, SinksOverEveryKeyAreSoftmax) {
  for (const char* map : {"elu", "favor"}) {
    const Case c{true, 2, map, false, true, 17, 30, 30};
    Inputs x(c, 5);
    const Tensor<double> got = hybrid_attention<double>(x.q, x.k, x.v, x.inputs(), x.opts);
    AttentionOptions so;
    so.causal = true;
    so.key_lengths = x.opts.key_lengths;
    const Tensor<double> want = softmax_attention<double>(x.q, x.k, x.v, so).out;
    for (int64_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::abs(want[i]))) << map << " " << i;
  }
}

TEST(Hybrid, BadInputIsAnErrorNamingIt) {
  const Case c{true, 2, "given", true, false, 6, 6};
  Inputs x(c, 1);
  auto err = [&](HybridInputs<double> in, HybridAttentionOptions o) {
    return testing::error_of([&] { hybrid_attention<double>(x.q, x.k, x.v, in, o); });
  };
  auto has = [](const std::string& msg, const char* what) {
    return msg.find(what) != std::string::npos ? ::testing::AssertionSuccess()
                                               : ::testing::AssertionFailure() << msg << " lacks " << what;
  };
  HybridAttentionOptions o = x.opts;
  o.window = -1;
  EXPECT_TRUE(has(err(x.inputs(), o), "window must be >= 0"));
  o.window = 2;
  o.sinks = -1;
  EXPECT_TRUE(has(err(x.inputs(), o), "sinks must be >= 0"));
  o.sinks = 2;
  o.causal = false;
  EXPECT_TRUE(has(err(x.inputs(), o), "sinks = 2 needs causal=true"));
  o.sinks = 0;
  Tensor<double> decay({3});
  HybridInputs<double> decayed = x.inputs();
  decayed.log_decay = decay.view();
  EXPECT_TRUE(has(err(decayed, o), "log_decay needs causal=true"));
  o.causal = true;
  decay[1] = 0.5;
  EXPECT_TRUE(has(err(decayed, o), "log_decay must be finite and <= 0, got 0.5 at head 1"));
  Tensor<double> two({2});
  decayed.log_decay = two.view();
  EXPECT_TRUE(has(err(decayed, o), "log_decay has shape [2]; expected [3]"));
  o = x.opts;
  o.feature_map = "cosine";
  EXPECT_TRUE(has(err(x.inputs(), o), "feature_map must be \"elu\", \"relu\", \"focused\", \"given\" or \"favor\", got"));
  o = x.opts;
  o.focus_power = 2;
  EXPECT_TRUE(has(err(x.inputs(), o), "focus_power=2 applies to feature_map='focused' only"));
  o.feature_map = "focused";
  o.focus_power = 0.5;
  HybridInputs<double> plain = x.inputs();
  plain.query_features.reset();
  plain.key_features.reset();
  EXPECT_TRUE(has(err(plain, o), "focus_power must be a number in [1, 1000], got 0.5"));
  HybridInputs<double> in = x.inputs();
  in.key_features.reset();
  EXPECT_TRUE(has(err(in, x.opts), "feature_map='given' needs query_features"));
  o = x.opts;
  o.feature_map = "elu";
  EXPECT_TRUE(has(err(x.inputs(), o), "pass feature_map='given'"));
  const Tensor<double> bad_gate({2});
  in = x.inputs();
  in.window_gate = bad_gate.view();
  EXPECT_TRUE(has(err(in, x.opts), "window_gate has shape [2]; expected [3]"));
  Tensor<double> neg = cast<double>(x.fq);
  neg[4] = -0.5;
  in = x.inputs();
  in.query_features = neg.view();
  EXPECT_TRUE(has(err(in, x.opts), "query_features must be finite and >= 0"));
  const Tensor<double> narrow({Inputs::B, Inputs::H, c.n_k, Inputs::m - 1});
  in = x.inputs();
  in.key_features = narrow.view();
  EXPECT_TRUE(has(err(in, x.opts), "key_features has shape"));
  o = x.opts;
  o.eps = -1;
  EXPECT_TRUE(has(err(x.inputs(), o), "eps must be finite and >= 0"));
  // FAVOR's options.
  Inputs xf(Case{true, 2, "favor", true, false, 6, 6}, 1);
  auto err_f = [&](HybridInputs<double> in_f, HybridAttentionOptions of) {
    return testing::error_of([&] { hybrid_attention<double>(xf.q, xf.k, xf.v, in_f, of); });
  };
  o = xf.opts;
  o.kernel = "trig";
  EXPECT_TRUE(has(err_f(xf.inputs(), o), "kernel must be 'positive' or 'hyperbolic' with feature_map='favor'"));
  in = xf.inputs();
  in.projection.reset();
  EXPECT_TRUE(has(err_f(in, xf.opts), "feature_map='favor' needs projection"));
  const Tensor<double> wide({Inputs::num_features, Inputs::d + 1});
  in = xf.inputs();
  in.projection = wide.view();
  EXPECT_TRUE(has(err_f(in, xf.opts), "projection has shape [4, 6]; expected [num_features >= 1, 5]"));
  o = xf.opts;
  o.scale = -0.5;
  EXPECT_TRUE(has(err_f(xf.inputs(), o), "scale must be > 0 for random features"));
  o = xf.opts;
  o.feature_map = "elu";
  EXPECT_TRUE(has(err_f(xf.inputs(), o), "projection is given, but feature_map is 'elu'"));
  o = x.opts;
  o.kernel = "hyperbolic";
  EXPECT_TRUE(has(err(x.inputs(), o), "kernel='hyperbolic' applies to feature_map='favor' only"));
}

}  // namespace
}  // namespace linattn

namespace linattn {
namespace {

// hybrid_decode_step token by token from an empty state equals the causal forward's rows
// (reference::hybrid_attention in float64, given features, a gate, with and without sinks and
// decay, windows shorter and longer than the sequence), at the forward's rounding bound; a row
// that does not advance gets 0 and keeps its state; bad input changes nothing.
// With `prefilled` tokens, the state after the first ones is hybrid_prefill's, and the steps
// continue from it.
template <class T>
void check_decode_step(const Case& c, int threads, int64_t kv_heads, int64_t prefilled = 0) {
  SCOPED_TRACE(name(c) + " " + std::to_string(threads) + " threads, " + std::to_string(kv_heads) + " key heads, " +
               std::to_string(prefilled) + " prefilled");
  testing::ScopedThreads scope(threads);
  constexpr int64_t B = Inputs::B, H = Inputs::H, d = Inputs::d, dv = Inputs::dv;
  const int64_t G = H / kv_heads;  // query heads per key head
  Inputs x(c, 500 + static_cast<uint64_t>(c.window) * 3 + c.sinks);
  x.round_to<T>();
  // FAVOR: the step makes the logits itself from the projection, and keeps per-feature shifts
  const bool favor = x.favor;
  const int64_t m = favor ? (c.map == "favor-hyperbolic" ? 2 : 1) * Inputs::num_features : Inputs::m;
  const Tensor<T> projection = cast<T>(x.projection);
  // Grouped queries: every query head of a group sees its key head's keys and values (those of
  // the group's first query head). (H = 3 allows groups of 1 and 3 only; the cache's tests run
  // 4 query heads on 2 key heads through the model.)
  for (Tensor<double>* t : {&x.k, &x.v})
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; h % G != 0 && i < c.n_q; ++i) {
          const TensorView<double> view = t->view();
          const double* from = view.row(b * H + h / G * G, i);
          std::copy(from, from + t->dim(3), view.row(b * H + h, i));
        }
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  const Tensor<double> want = reference::hybrid_attention(x.q, x.k, x.v, x.inputs(), x.opts);
  const Tensor<double> bound = bound_of(reference::hybrid_attention(x.q, x.k, x.v, x.inputs(), x.opts, true),
                                        epsilon<T>(x, c, scale));
  const int64_t n = c.n_q, w = c.window, s = c.sinks, slots = s + w;
  Tensor<T> sums({B, H, m, dv}), normaliser({B, H, m}), keys({B, kv_heads, slots, d}), values({B, kv_heads, slots, dv});
  Tensor<bool> valid({B, slots});
  Tensor<int64_t> counts({B});
  Tensor<T> gamma({H}), decay({H});
  for (int64_t h = 0; h < H; ++h) {
    gamma[h] = static_cast<T>(1 / (1 + std::exp(-x.gate[h])));
    decay[h] = static_cast<T>(x.log_decay[h]);
  }
  Tensor<T> shift({B, H, m});
  std::fill(shift.data(), shift.data() + shift.size(), -std::numeric_limits<T>::infinity());
  const HybridDecodeState<T> state{sums.view(), normaliser.view(), keys.view(), values.view(), valid.view(),
                                   counts.view(), favor ? shift.view() : TensorView<T>{}};
  HybridDecodeOptions opts{w, s, scale, x.opts.eps};
  if (favor) opts.feature_map = "favor", opts.kernel = x.opts.kernel;
  const FavorFeatures<T> favor_features{projection.view()};
  Tensor<T> q({B, H, d}), k({B, kv_heads, d}), v({B, kv_heads, dv}), fq({B, H, m}), fl({B, H, m});
  Tensor<bool> advance({B});
  auto token = [&](int64_t t) {  // position t's rows of every (b, h), and φ of the key leaving (t − w)
    for (int64_t bg = 0; bg < B * kv_heads; ++bg) {  // a key head's rows: its group's first query head's
      const int64_t bh = bg / kv_heads * H + bg % kv_heads * G;
      for (int64_t i = 0; i < d; ++i) k[bg * d + i] = static_cast<T>(x.k.view().row(bh, t)[i]);
      for (int64_t i = 0; i < dv; ++i) v[bg * dv + i] = static_cast<T>(x.v.view().row(bh, t)[i]);
    }
    for (int64_t bh = 0; bh < B * H; ++bh) {
      for (int64_t i = 0; i < d; ++i) q[bh * d + i] = static_cast<T>(x.q.view().row(bh, t)[i]);
      for (int64_t i = 0; i < m; ++i) {
        fq[bh * m + i] = static_cast<T>(x.fq.view().row(bh, t)[i]);
        fl[bh * m + i] = t >= w ? static_cast<T>(x.fk.view().row(bh, t - w)[i]) : T(0);
      }
    }
  };
  auto step = [&] {
    const TensorView<const T> log_decay = c.decay ? TensorView<const T>(decay.view()) : TensorView<const T>{};
    if (favor)
      return hybrid_decode_step<T>(q.view(), k.view(), v.view(), favor_features, advance.view(), gamma.view(),
                                   log_decay, state, opts);
    return hybrid_decode_step<T>(q.view(), k.view(), v.view(), fq.view(), fl.view(), advance.view(), gamma.view(),
                                 log_decay, state, opts);
  };
  if (prefilled > 0) {  // the first tokens' keys, values and key features, as token() gives them
    Tensor<T> kp({B, kv_heads, prefilled, d}), vp({B, kv_heads, prefilled, dv}), fk({B, H, prefilled, m});
    for (int64_t t = 0; t < prefilled; ++t) {
      token(t);
      for (int64_t bg = 0; bg < B * kv_heads; ++bg) {
        std::copy(k.data() + bg * d, k.data() + (bg + 1) * d, kp.data() + (bg * prefilled + t) * d);
        std::copy(v.data() + bg * dv, v.data() + (bg + 1) * dv, vp.data() + (bg * prefilled + t) * dv);
      }
      for (int64_t bh = 0; bh < B * H; ++bh)
        for (int64_t i = 0; i < m && !favor; ++i)
          fk[(bh * prefilled + t) * m + i] = static_cast<T>(x.fk.view().row(bh, t)[i]);
    }
    const TensorView<const T> log_decay = c.decay ? TensorView<const T>(decay.view()) : TensorView<const T>{};
    if (favor)
      hybrid_prefill<T>(kp.view(), vp.view(), favor_features, TensorView<const bool>{}, log_decay, state, opts);
    else
      hybrid_prefill<T>(kp.view(), vp.view(), fk.view(), TensorView<const bool>{}, log_decay, state, opts);
    EXPECT_EQ(counts[0], prefilled);
  }
  for (int64_t t = prefilled; t < n; ++t) {
    token(t);
    // at t = 2 row 1 does not advance first (a padded position): 0 out, its state unchanged
    if (t == 2) {
      advance[0] = true, advance[1] = false;
      const std::vector<T> before(sums.data(), sums.data() + sums.size());
      const std::vector<T> shift_before(shift.data(), shift.data() + shift.size());
      const std::vector<T> keys_before(keys.data(), keys.data() + keys.size());
      const int64_t count1 = counts[1];
      Tensor<T> padded = step();
      for (int64_t i = B * H * dv / 2; i < B * H * dv; ++i) EXPECT_EQ(padded[i], T(0));
      for (int64_t i = sums.size() / 2; i < sums.size(); ++i) EXPECT_EQ(sums[i], before[i]);
      for (int64_t i = shift.size() / 2; i < shift.size(); ++i) EXPECT_EQ(shift[i], shift_before[i]);
      for (int64_t i = keys.size() / 2; i < keys.size(); ++i) EXPECT_EQ(keys[i], keys_before[i]);
      EXPECT_EQ(counts[1], count1);
      advance[0] = false, advance[1] = true;  // and now row 1's token, row 0 padded
      const Tensor<T> out = step();
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < dv; ++i) {
          EXPECT_EQ(out[h * dv + i], T(0));
          const int64_t bh = H + h;
          EXPECT_NEAR(static_cast<double>(out[bh * dv + i]), want.view().row(bh, t)[i], bound.view().row(bh, t)[i]);
          EXPECT_NEAR(static_cast<double>(padded[h * dv + i]), want.view().row(h, t)[i], bound.view().row(h, t)[i]);
        }
      continue;
    }
    advance[0] = advance[1] = true;
    const Tensor<T> out = step();
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t i = 0; i < dv; ++i)
        ASSERT_NEAR(static_cast<double>(out[bh * dv + i]), want.view().row(bh, t)[i], bound.view().row(bh, t)[i])
            << "t " << t << " bh " << bh << " i " << i;
  }
  EXPECT_EQ(counts[0], n);
  // bad input: an error naming it, and nothing written
  const std::vector<T> sums_before(sums.data(), sums.data() + sums.size());
  const std::vector<T> keys_before(keys.data(), keys.data() + keys.size());
  const std::vector<T> values_before(values.data(), values.data() + values.size());
  const std::vector<bool> valid_before(valid.data(), valid.data() + valid.size());
  const std::vector<T> shift_before(shift.data(), shift.data() + shift.size());
  gamma[1] = T(2);
  testing::expect_error([&] { step(); }, "window_weight must be in [0, 1]");
  gamma[1] = T(0.5);
  if (!favor) {
    fq[3] = T(-1);
    testing::expect_error([&] { step(); }, "query_features must be finite and >= 0");
    fq[3] = T(1);
  } else {  // a shift of +inf or NaN is no scale
    const T before = shift[2];
    shift[2] = std::numeric_limits<T>::infinity();
    testing::expect_error([&] { step(); }, "hybrid_decode_step: shift must be finite or -inf, got inf at flat index 2");
    shift[2] = before;
  }
  k[0] = std::numeric_limits<T>::quiet_NaN();
  testing::expect_error([&] { step(); }, "k has a non-finite value");
  k[0] = T(0);
  if (kv_heads == 1 && !favor) {  // 2 key heads for 3 query heads
    const Tensor<T> k2({B, 2, d}), v2({B, 2, dv});
    testing::expect_error([&] {
      hybrid_decode_step<T>(q.view(), k2.view(), v2.view(), fq.view(), fl.view(), advance.view(), gamma.view(),
                            TensorView<const T>{}, state, opts);
    }, "v has 2 key/value heads, which must divide q's 3 heads");
  }
  EXPECT_EQ(std::vector<T>(sums.data(), sums.data() + sums.size()), sums_before);
  EXPECT_EQ(std::vector<T>(keys.data(), keys.data() + keys.size()), keys_before);
  EXPECT_EQ(std::vector<T>(values.data(), values.data() + values.size()), values_before);
  EXPECT_EQ(std::vector<bool>(valid.data(), valid.data() + valid.size()), valid_before);
  for (int64_t i = 0; i < shift.size(); ++i)  // (−inf == −inf: EXPECT_EQ holds for unfilled features too)
    EXPECT_EQ(shift[i], shift_before[i]) << i;
  EXPECT_EQ(counts[0], n);
}

TEST(HybridDecodeStep, EqualsTheCausalForwardRowByRow) {
  for (int threads : {1, 3, 8})
    for (const auto& [w, sinks, decayed] : {std::tuple{0, 0, false}, std::tuple{0, 0, true}, std::tuple{1, 0, false},
                                            std::tuple{3, 0, true}, std::tuple{8, 2, false}, std::tuple{4, 4, true},
                                            std::tuple{30, 3, true}}) {
      for (const char* map : {"given", "favor", "favor-hyperbolic"}) {
        const Case c{true, w, map, true, false, 23, 23, sinks, decayed};
        for (int64_t kv_heads : {Inputs::H, int64_t{1}})
          for (int64_t prefilled : {0, 5, 17}) {
            check_decode_step<float>(c, threads, kv_heads, prefilled);
            check_decode_step<double>(c, threads, kv_heads, prefilled);
          }
      }
    }
}

// FAVOR's trig kernel (window 0 only: its weights may be negative) stepped token by token (the
// first 6 tokens prefilled) equals the causal favor_attention by definition, out_i = Σ_{j<=i}
// φ(q_i)·φ(k_j) v_j / Σ_{j<=i} φ(q_i)·φ(k_j) with reference::features' trig φ in float64.
// Bound: each term φ_r(q)φ_r(k) = e^{h_q + h_k}/m·s_r(q)s_r(k) (|s| <= 1) is made from logits
// U = ω·x̃ (d-term sums: |ΔU| <= γ_{d+1}A, A = max Σ|ω_t x̃_t|) and h = ‖x̃‖²/2 (γ_{d+2}h), its
// sin, cos and exp within 4u each (Highway's and the C library's, a few ulp), then summed over
// at most n keys and m' features on one scale: |Δterm| <= ε·e^{h_q + h_k}/m with
// ε = 2(γ_{d+1}A + 4u) + 2γ_{d+2}h_max + 8u + γ_{n+m'+4}. So |Δout_i| <= ε·(M_num + |out_i|·M_den)
// / |den_i|, M the sums of e^{h_q + h_k}·2 (m' = 2m terms of e^{h_q+h_k}/m) times |v_j| or 1.
template <class T>
void check_trig_step(int threads) {
  SCOPED_TRACE(std::string(dtype_name<T>()) + " " + std::to_string(threads) + " threads");
  testing::ScopedThreads scope(threads);
  constexpr int64_t B = 2, H = 3, n = 17, d = 4, m = 3, mp = 2 * m, dv = 3, prompt = 6;
  const Tensor<T> q = random_tensor<T>({B, H, n, d}, 911, 0.7), k = random_tensor<T>({B, H, n, d}, 912, 0.7);
  const Tensor<T> v = random_tensor<T>({B, H, n, dv}, 913), projection = random_tensor<T>({m, d}, 914);
  const Tensor<double> q64 = cast<double>(q), k64 = cast<double>(k), v64 = cast<double>(v), w64 = cast<double>(projection);
  const double scale = 1 / std::sqrt(double(d)), u = std::ldexp(1.0, -std::numeric_limits<T>::digits);
  const Tensor<double> fq = reference::features(TensorView<const double>(q64.data(), {B * H * n, d}), "trig", w64.view(), scale);
  const Tensor<double> fk = reference::features(TensorView<const double>(k64.data(), {B * H * n, d}), "trig", w64.view(), scale);
  double A = 0, h_max = 0;
  std::vector<double> h(static_cast<size_t>(2 * B * H * n));  // h of q's rows, then k's
  for (int64_t row = 0; row < 2 * B * H * n; ++row) {
    const double* x = (row < B * H * n ? q64.data() : k64.data() - B * H * n * d) + row * d;
    double hh = 0;
    for (int64_t t = 0; t < d; ++t) hh += scale * x[t] * x[t] / 2;
    h[static_cast<size_t>(row)] = hh;
    h_max = std::max(h_max, hh);
    for (int64_t r = 0; r < m; ++r) {
      double a = 0;
      for (int64_t t = 0; t < d; ++t) a += std::abs(w64[r * d + t] * std::sqrt(scale) * x[t]);
      A = std::max(A, a);
    }
  }
  const double eps = 2 * (testing::gamma<T>(double(d + 1)) * A + 4 * u) + 2 * testing::gamma<T>(double(d + 2)) * h_max +
                     8 * u + testing::gamma<T>(double(n + mp + 4));
  Tensor<T> sums({B, H, mp, dv}), normaliser({B, H, mp}), keys({B, H, 0, d}), values({B, H, 0, dv}), shift({B, H, mp});
  Tensor<bool> valid({B, 0}), advance({B});
  Tensor<int64_t> counts({B});
  const HybridDecodeState<T> state{sums.view(), normaliser.view(), keys.view(), values.view(), valid.view(),
                                   counts.view(), shift.view()};
  HybridDecodeOptions opts{0, 0, scale, 0.0};
  opts.feature_map = "favor", opts.kernel = "trig";
  const FavorFeatures<T> favor{projection.view()};
  Tensor<T> kp({B, H, prompt, d}), vp({B, H, prompt, dv});
  for (int64_t bh = 0; bh < B * H; ++bh) {
    std::copy(k.data() + bh * n * d, k.data() + (bh * n + prompt) * d, kp.data() + bh * prompt * d);
    std::copy(v.data() + bh * n * dv, v.data() + (bh * n + prompt) * dv, vp.data() + bh * prompt * dv);
  }
  hybrid_prefill<T>(kp.view(), vp.view(), favor, TensorView<const bool>{}, TensorView<const T>{}, state, opts);
  const Tensor<T> gamma({H});
  advance[0] = advance[1] = true;
  for (int64_t t = prompt; t < n; ++t) {
    Tensor<T> qt({B, H, d}), kt({B, H, d}), vt({B, H, dv});
    for (int64_t bh = 0; bh < B * H; ++bh) {
      std::copy(q.data() + (bh * n + t) * d, q.data() + (bh * n + t + 1) * d, qt.data() + bh * d);
      std::copy(k.data() + (bh * n + t) * d, k.data() + (bh * n + t + 1) * d, kt.data() + bh * d);
      std::copy(v.data() + (bh * n + t) * dv, v.data() + (bh * n + t + 1) * dv, vt.data() + bh * dv);
    }
    const Tensor<T> out = hybrid_decode_step<T>(qt.view(), kt.view(), vt.view(), favor, advance.view(), gamma.view(),
                                                TensorView<const T>{}, state, opts);
    for (int64_t bh = 0; bh < B * H; ++bh) {
      std::vector<double> num(dv, 0.0), mag_num(dv, 0.0);
      double den = 0, mag_den = 0;
      for (int64_t j = 0; j <= t; ++j) {
        double w = 0;
        for (int64_t r = 0; r < mp; ++r) w += fq[(bh * n + t) * mp + r] * fk[(bh * n + j) * mp + r];
        const double size = 2 * std::exp(h[static_cast<size_t>(bh * n + t)] + h[static_cast<size_t>(B * H * n + bh * n + j)]);
        den += w, mag_den += size;
        for (int64_t e = 0; e < dv; ++e) num[e] += w * v64[(bh * n + j) * dv + e], mag_num[e] += size * std::abs(v64[(bh * n + j) * dv + e]);
      }
      for (int64_t e = 0; e < dv; ++e) {
        const double want = num[e] / den;
        const double bound = eps * (mag_num[e] + std::abs(want) * mag_den) / std::abs(den);
        ASSERT_NEAR(double(out[bh * dv + e]), want, bound) << "t " << t << " bh " << bh << " e " << e;
      }
    }
  }
  EXPECT_EQ(counts[0], n);
  HybridDecodeOptions windowed = opts;  // trig's weights may be negative: never beside a window
  windowed.window = 2;
  const Tensor<T> q1({B, H, d}), k1({B, H, d}), v1({B, H, dv});
  testing::expect_error([&] {
    hybrid_decode_step<T>(q1.view(), k1.view(), v1.view(), favor, advance.view(), gamma.view(), TensorView<const T>{},
                          state, windowed);
  }, "hybrid_decode_step: kernel=\"trig\" needs window 0");
}

TEST(HybridDecodeStep, FavorTrigWithoutAWindowIsFavorAttention) {
  for (int threads : {1, 3}) {
    check_trig_step<float>(threads);
    check_trig_step<double>(threads);
  }
}

// hybrid_decode_step applying a map itself (Hedgehog's maps, or a fixed map by name) equals the
// step with the features given, made by hedgehog_features or features() (φ_q of the query; φ_k of
// the key leaving the window, each query head's key map on its key head's key), token by token
// over a sequence longer than window + sinks, with grouped key heads and a padded row, at a
// tolerance derived below from the maps' rounding (0 for relu: the same bits). Bad maps are an
// error naming them, with nothing written.
template <class T>
void check_decode_step_maps(const std::string& map, int64_t kv_heads, int threads, int64_t w) {
  SCOPED_TRACE(map + " " + std::string(dtype_name<T>()) + " " + std::to_string(kv_heads) + " key heads, " +
               std::to_string(threads) + " threads, w=" + std::to_string(w));
  const bool hedgehog = map == "hedgehog";
  testing::ScopedThreads scope(threads);
  constexpr int64_t B = 2, H = 6, d = 5, dv = 4, f = 3, n = 21;
  const int64_t s = w ? 2 : 0, slots = s + w;  // window 0: linear attention alone, no sinks
  const int64_t m = hedgehog ? 2 * f : d;
  const int64_t G = H / kv_heads;
  const Tensor<double> q = random_tensor<double>({B, H, n, d}, 701), k = random_tensor<double>({B, kv_heads, n, d}, 702);
  const Tensor<double> v = random_tensor<double>({B, kv_heads, n, dv}, 703);
  const Tensor<double> qw = random_tensor<double>({H, d, f}, 704, 0.7), qb = random_tensor<double>({H, f}, 705, 0.3);
  const Tensor<double> kw = random_tensor<double>({H, d, f}, 706, 0.7), kb = random_tensor<double>({H, f}, 707, 0.3);
  const Tensor<T> qwt = cast<T>(qw), qbt = cast<T>(qb), kwt = cast<T>(kw), kbt = cast<T>(kb);
  // Each query head's key map on its key head's keys: [B, H, n, d] for hedgehog_features.
  Tensor<T> k_per_query({B, H, n, d});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n * d; ++i) k_per_query[(b * H + h) * n * d + i] = static_cast<T>(k[(b * kv_heads + h / G) * n * d + i]);
  const Tensor<T> qt = cast<T>(q);
  RecurrentOptions fixed_map;
  fixed_map.feature_map = hedgehog ? "elu" : map;
  fixed_map.focus_power = 2.5;
  // the features as a caller gives them: the public functions' (BLAS products and row blocks)
  const auto map_of = [&](const Tensor<T>& x, bool query) {
    return hedgehog ? hedgehog_features<T>(x.view(), (query ? qwt : kwt).view(), (query ? qbt : kbt).view())
                    : features<T>(x.view(), fixed_map);
  };
  const Tensor<T> fq_all = map_of(qt, true);
  // ρ: how far each path's features may be from the exact ones, relatively. Hedgehog:
  // hedgehog_bounds.h's ρ (the two paths sum x·W in different orders). A fixed map runs
  // FeatureMap's row code either way, but its vector exp may take another path for one row than
  // for a block: elu within 2.6u|φ| in float32, 2u in float64, focused within γ_{d+8}|φ|
  // (kernelized_bounds.h); relu is exact, so its two paths see the same bits and give the same.
  const double u = std::ldexp(1.0, -std::numeric_limits<T>::digits);
  const double rho =
      hedgehog ? std::max(testing::hedgehog_bound<T>(q, qw, qb), testing::hedgehog_bound<T>(cast<double>(k_per_query), kw, kb))
      : map == "elu"     ? (std::is_same_v<T, float> ? 2.6 : 2.0) * u
      : map == "focused" ? testing::gamma<T>(static_cast<double>(d + 8))
                         : 0.0;
  // Each term φ_q·φ_k of the sums and the normaliser (>= 0) then differs between the paths by at
  // most δ = ((1 + ρ)/(1 − ρ))² − 1 relatively, so the output N/D (|N| <= D·max|v|) by at most
  // 2δ·max|v|/(1 − δ). Each path also rounds its own arithmetic: terms that pass through at most
  // 2n decayed updates of the sums, a sum of s + w + m' terms, exp (2.6u) and a few products:
  // η = γ_{2n + s + w + m' + 4} + 2.6u relatively on N and D, 2η·max|v|/(1 − η) on the output,
  // twice over for the two paths. Identical features (relu) give identical bits: tolerance 0.
  double vmax = 0;
  for (int64_t i = 0; i < v.size(); ++i) vmax = std::max(vmax, std::abs(v[i]));
  const double delta = std::pow((1 + rho) / (1 - rho), 2) - 1;
  const double eta = testing::gamma<T>(static_cast<double>(2 * n + slots + m + 4)) + 2.6 * u;
  const double tol = rho == 0 ? 0.0 : 2 * delta * vmax / (1 - delta) + 4 * eta * vmax / (1 - eta);
  struct Run {
    Tensor<T> sums, normaliser, keys, values;
    Tensor<bool> valid;
    Tensor<int64_t> counts;
    HybridDecodeState<T> state() { return {sums.view(), normaliser.view(), keys.view(), values.view(), valid.view(), counts.view()}; }
  };
  auto fresh = [&] {
    return Run{Tensor<T>({B, H, m, dv}), Tensor<T>({B, H, m}), Tensor<T>({B, kv_heads, slots, d}),
               Tensor<T>({B, kv_heads, slots, dv}), Tensor<bool>({B, slots}), Tensor<int64_t>({B})};
  };
  Run with_maps = fresh(), given = fresh();
  Tensor<T> gamma({H}), decay({H});
  for (int64_t h = 0; h < H; ++h) gamma[h] = static_cast<T>(0.3 + 0.1 * double(h)), decay[h] = static_cast<T>(-0.02 * double(h));
  const HybridDecodeOptions opts{w, s, 1 / std::sqrt(double(d)), 1e-6};
  HybridDecodeOptions made_opts = opts;  // the fixed map's name: the step applies it
  if (!hedgehog) made_opts.feature_map = map, made_opts.focus_power = fixed_map.focus_power;
  const HedgehogMaps<T> maps{qwt.view(), qbt.view(), kwt.view(), kbt.view()};
  Tensor<T> qs({B, H, d}), ks({B, kv_heads, d}), vs({B, kv_heads, dv}), fq({B, H, m}), fl({B, H, m});
  Tensor<bool> advance({B});
  for (int64_t t = 0; t < n; ++t) {
    advance[0] = true;
    advance[1] = t % 5 != 3;  // row 1 padded now and then: it runs fewer tokens
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < d; ++i) qs[(b * H + h) * d + i] = static_cast<T>(q[((b * H + h) * n + t) * d + i]);
      for (int64_t g = 0; g < kv_heads; ++g) {
        for (int64_t i = 0; i < d; ++i) ks[(b * kv_heads + g) * d + i] = static_cast<T>(k[((b * kv_heads + g) * n + t) * d + i]);
        for (int64_t i = 0; i < dv; ++i) vs[(b * kv_heads + g) * dv + i] = static_cast<T>(v[((b * kv_heads + g) * n + t) * dv + i]);
      }
      // the row's tokens so far are its own: the leaving one is the token `w` of its tokens back
      const int64_t c = given.counts[b];
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < m; ++r) {
          fq[(b * H + h) * m + r] = fq_all[((b * H + h) * n + t) * m + r];
          fl[(b * H + h) * m + r] = T(0);
        }
      if (c >= w) {  // the key in the leaving slot, as the ring holds it (w = 0: the new key), through the map
        Tensor<T> leaving({1, H, 1, d});
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < d; ++i)
            leaving[h * d + i] = w ? given.keys[((b * kv_heads + h / G) * slots + s + c % w) * d + i]
                                   : ks[(b * kv_heads + h / G) * d + i];
        const Tensor<T> phi = map_of(leaving, false);
        for (int64_t i = 0; i < H * m; ++i) fl[b * H * m + i] = phi[i];
      }
    }
    const Tensor<T> got =
        hedgehog ? hybrid_decode_step<T>(qs.view(), ks.view(), vs.view(), maps, advance.view(), gamma.view(),
                                         decay.view(), with_maps.state(), opts)
                 : hybrid_decode_step<T>(qs.view(), ks.view(), vs.view(), TensorView<const T>{}, TensorView<const T>{},
                                         advance.view(), gamma.view(), decay.view(), with_maps.state(), made_opts);
    const Tensor<T> want = hybrid_decode_step<T>(qs.view(), ks.view(), vs.view(), fq.view(), fl.view(), advance.view(),
                                                 gamma.view(), decay.view(), given.state(), opts);
    for (int64_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(double(got[i]), double(want[i]), tol) << "t " << t << " at " << i;
  }
  EXPECT_EQ(with_maps.counts[1], given.counts[1]);
  EXPECT_LT(with_maps.counts[1], n);
  if (!hedgehog) {  // a fixed map's errors: a wrong name, features passed as well
    HybridDecodeOptions bad = made_opts;
    bad.feature_map = "softmax";
    testing::expect_error([&] {
      hybrid_decode_step<T>(qs.view(), ks.view(), vs.view(), TensorView<const T>{}, TensorView<const T>{},
                            advance.view(), gamma.view(), decay.view(), with_maps.state(), bad);
    }, "hybrid_decode_step: feature_map must be \"elu\", \"relu\", \"focused\" or \"given\"; got \"softmax\"");
    testing::expect_error([&] {
      hybrid_decode_step<T>(qs.view(), ks.view(), vs.view(), fq.view(), fl.view(), advance.view(), gamma.view(),
                            decay.view(), with_maps.state(), made_opts);
    }, "the step makes the features itself: query_features and leaving_features must be empty");
    EXPECT_EQ(with_maps.counts[0], given.counts[0]);
    return;
  }
  // bad maps: an error naming them, nothing written
  const std::vector<T> keys_before(with_maps.keys.data(), with_maps.keys.data() + with_maps.keys.size());
  const std::vector<T> sums_before(with_maps.sums.data(), with_maps.sums.data() + with_maps.sums.size());
  const int64_t count0 = with_maps.counts[0];
  auto step_with = [&](const HedgehogMaps<T>& bad) {
    hybrid_decode_step<T>(qs.view(), ks.view(), vs.view(), bad, advance.view(), gamma.view(), decay.view(),
                          with_maps.state(), opts);
  };
  const Tensor<T> wrong_w({H, d + 1, f}), wrong_b({H, f + 1});
  testing::expect_error([&] { step_with({wrong_w.view(), qbt.view(), kwt.view(), kbt.view()}); },
                        "hybrid_decode_step: query_weight has shape [6, 6, 3]; expected [heads = 6, head_dim = 5, feature_dim >= 1]");
  testing::expect_error([&] { step_with({qwt.view(), wrong_b.view(), kwt.view(), kbt.view()}); },
                        "hybrid_decode_step: query_bias has shape [6, 4]; expected [6, 3]");
  testing::expect_error([&] { step_with({qwt.view(), qbt.view(), wrong_w.view(), kbt.view()}); },
                        "hybrid_decode_step: key_weight has shape [6, 6, 3]; expected [6, 5, 3]");
  Tensor<T> nan_b = cast<T>(kb);
  nan_b[2] = std::numeric_limits<T>::quiet_NaN();
  testing::expect_error([&] { step_with({qwt.view(), qbt.view(), kwt.view(), nan_b.view()}); },
                        "hybrid_decode_step: key_bias has a non-finite value at flat index 2");
  const Tensor<T> other_maps({H, d, f + 1}), other_bias({H, f + 1});  // m' = 8 against sums of m' = 6
  testing::expect_error([&] { step_with({other_maps.view(), other_bias.view(), other_maps.view(), other_bias.view()}); },
                        "hybrid_decode_step: sums has shape [2, 6, 6, 4]; expected [2, 6, 8, 4]");
  EXPECT_EQ(std::vector<T>(with_maps.keys.data(), with_maps.keys.data() + with_maps.keys.size()), keys_before);
  EXPECT_EQ(std::vector<T>(with_maps.sums.data(), with_maps.sums.data() + with_maps.sums.size()), sums_before);
  EXPECT_EQ(with_maps.counts[0], count0);
}

TEST(HybridDecodeStep, MapsAppliedByTheStepEqualGivenFeatures) {
  for (const char* map : {"hedgehog", "elu", "relu", "focused"})
    for (int threads : {1, 3, 8})
      for (int64_t kv_heads : {int64_t{6}, int64_t{2}, int64_t{1}})
        for (int64_t w : {4, 0}) {
          check_decode_step_maps<float>(map, kv_heads, threads, w);
          check_decode_step_maps<double>(map, kv_heads, threads, w);
        }
}

// A step large enough to run on several workers (B·H·work per head >= 2^18: here 2 rows of 8
// query heads on 2 key heads or on 1, d = d_v = 64, m' = 64, w = 64 + 4 sinks, with decay and a
// padded row; Hedgehog's maps, f = 32) gives each query head bitwise what a step of that head
// alone gives (a one-head step runs on the calling thread): every head is computed once, by its
// own arithmetic (up to 4 query heads of a key head read its slots together, each in its own
// sums), whatever the grouping, the order and the worker. FAVOR's step (positive features, m' =
// 64) makes every head's query logits in one product, summed in another order than a head's
// alone: it gives bitwise what the step gives with one key head per query head (each query
// head's keys and values repeated), ungrouped. At 1, 2, 3, 8 and 32 threads (4 tasks of a row,
// a key head and its 4 query heads; 16 rows and query heads: below and above both), 80 tokens.
TEST(HybridDecodeStep, SeveralWorkersGiveEachHeadItsOwnStep) {
  using T = float;
  constexpr int64_t B = 2, H = 8, d = 64, dv = 64, f = 32, m = 2 * f, w = 64, s = 4, slots = s + w, n = 80;
  const Tensor<T> qw = cast<T>(random_tensor<double>({H, d, f}, 801, 0.2)), qb = cast<T>(random_tensor<double>({H, f}, 802));
  const Tensor<T> kw = cast<T>(random_tensor<double>({H, d, f}, 803, 0.2)), kb = cast<T>(random_tensor<double>({H, f}, 804));
  Tensor<T> gamma({H}), decay({H});
  for (int64_t h = 0; h < H; ++h) gamma[h] = T(0.2 + 0.05 * double(h)), decay[h] = T(-0.01 * double(h));
  const Tensor<T> omega = cast<T>(random_tensor<double>({m, d}, 805, 0.5));  // FAVOR's projection
  struct State {
    Tensor<T> sums, normaliser, keys, values;
    Tensor<bool> valid;
    Tensor<int64_t> counts;
    Tensor<T> shift;  // FAVOR's (−inf: no key yet)
    bool favor;
    State(int64_t heads, int64_t kv, bool favor)
        : sums({B, heads, m, dv}), normaliser({B, heads, m}), keys({B, kv, slots, d}), values({B, kv, slots, dv}),
          valid({B, slots}), counts({B}), shift({B, heads, m}), favor(favor) {
      std::fill(shift.data(), shift.data() + shift.size(), -std::numeric_limits<T>::infinity());
    }
    HybridDecodeState<T> view() {
      return {sums.view(), normaliser.view(), keys.view(), values.view(), valid.view(), counts.view(),
              favor ? shift.view() : TensorView<T>{}};
    }
  };
  // one head's maps, gate and decay: rows h of the model's
  auto head_of = [](const Tensor<T>& t, int64_t h) {
    Shape shape = t.shape();
    const int64_t per = t.size() / shape[0];
    shape[0] = 1;
    Tensor<T> out(shape);
    std::copy(t.data() + h * per, t.data() + (h + 1) * per, out.data());
    return out;
  };
  auto values = [](const Tensor<T>& x) { return std::vector<T>(x.data(), x.data() + x.size()); };
  for (bool favor : {false, true})
  for (int64_t kv_heads : {int64_t{2}, int64_t{1}})
  for (int threads : {1, 2, 3, 8, 32}) {
    SCOPED_TRACE(std::to_string(threads) + " threads, " + std::to_string(kv_heads) + " key heads" +
                 (favor ? ", FAVOR" : ", Hedgehog's maps"));
    testing::ScopedThreads scope(threads);
    const int64_t G = H / kv_heads;
    HybridDecodeOptions opts{w, s, 0.125, 1e-6};
    if (favor) opts.feature_map = "favor";
    State all(H, kv_heads, favor), ungrouped(H, H, favor);
    std::vector<State> alone;
    for (int64_t h = 0; h < H; ++h) alone.emplace_back(1, 1, favor);
    Tensor<bool> advance({B});
    for (int64_t t = 0; t < n; ++t) {
      const Tensor<T> q = cast<T>(random_tensor<double>({B, H, d}, 900 + 3 * t));
      const Tensor<T> k = cast<T>(random_tensor<double>({B, kv_heads, d}, 901 + 3 * t));
      const Tensor<T> v = cast<T>(random_tensor<double>({B, kv_heads, dv}, 902 + 3 * t));
      advance[0] = true;
      advance[1] = t % 7 != 5;
      const Tensor<T> out =
          favor ? hybrid_decode_step<T>(q.view(), k.view(), v.view(), FavorFeatures<T>{omega.view()}, advance.view(),
                                        gamma.view(), decay.view(), all.view(), opts)
                : hybrid_decode_step<T>(q.view(), k.view(), v.view(),
                                        HedgehogMaps<T>{qw.view(), qb.view(), kw.view(), kb.view()}, advance.view(),
                                        gamma.view(), decay.view(), all.view(), opts);
      if (favor) {
        Tensor<T> k_rep({B, H, d}), v_rep({B, H, dv});  // query head h's keys and values its own
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h) {
            std::copy(k.data() + (b * kv_heads + h / G) * d, k.data() + (b * kv_heads + h / G + 1) * d,
                      k_rep.data() + (b * H + h) * d);
            std::copy(v.data() + (b * kv_heads + h / G) * dv, v.data() + (b * kv_heads + h / G + 1) * dv,
                      v_rep.data() + (b * H + h) * dv);
          }
        const Tensor<T> want = hybrid_decode_step<T>(q.view(), k_rep.view(), v_rep.view(), FavorFeatures<T>{omega.view()},
                                                     advance.view(), gamma.view(), decay.view(), ungrouped.view(), opts);
        ASSERT_EQ(values(out), values(want)) << "t " << t;
        continue;
      }
      for (int64_t h = 0; h < H; ++h) {
        Tensor<T> qh({B, 1, d}), kh({B, 1, d}), vh({B, 1, dv});
        for (int64_t b = 0; b < B; ++b) {
          std::copy(q.data() + (b * H + h) * d, q.data() + (b * H + h + 1) * d, qh.data() + b * d);
          std::copy(k.data() + (b * kv_heads + h / G) * d, k.data() + (b * kv_heads + h / G + 1) * d, kh.data() + b * d);
          std::copy(v.data() + (b * kv_heads + h / G) * dv, v.data() + (b * kv_heads + h / G + 1) * dv, vh.data() + b * dv);
        }
        const Tensor<T> qwh = head_of(qw, h), qbh = head_of(qb, h), kwh = head_of(kw, h), kbh = head_of(kb, h);
        const Tensor<T> gh = head_of(gamma, h), dh = head_of(decay, h);
        const Tensor<T> one =
            favor ? hybrid_decode_step<T>(qh.view(), kh.view(), vh.view(), FavorFeatures<T>{omega.view()},
                                          advance.view(), gh.view(), dh.view(), alone[h].view(), opts)
                  : hybrid_decode_step<T>(qh.view(), kh.view(), vh.view(),
                                          HedgehogMaps<T>{qwh.view(), qbh.view(), kwh.view(), kbh.view()},
                                          advance.view(), gh.view(), dh.view(), alone[h].view(), opts);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t e = 0; e < dv; ++e)
            ASSERT_EQ(out[(b * H + h) * dv + e], one[b * dv + e]) << "t " << t << " b " << b << " h " << h << " e " << e;
      }
    }
    if (favor) {
      EXPECT_EQ(values(all.sums), values(ungrouped.sums));
      EXPECT_EQ(values(all.shift), values(ungrouped.shift));
      EXPECT_LT(all.counts[1], n);
      continue;
    }
    for (int64_t h = 0; h < H; ++h)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < m * dv; ++i)
          ASSERT_EQ(all.sums[(b * H + h) * m * dv + i], alone[h].sums[b * m * dv + i]) << "sums of head " << h;
    EXPECT_EQ(all.counts[1], alone[0].counts[1]);
    EXPECT_LT(all.counts[1], n);
  }
}

}  // namespace
}  // namespace linattn

namespace linattn {
namespace {

// The state hybrid_prefill leaves, held in tensors of T.
template <class T>
struct PrefillRun {
  Tensor<T> sums, normaliser, keys, values;
  Tensor<bool> valid;
  Tensor<int64_t> counts;
  PrefillRun(int64_t B, int64_t H, int64_t kv_heads, int64_t m, int64_t slots, int64_t d, int64_t dv)
      : sums({B, H, m, dv}), normaliser({B, H, m}), keys({B, kv_heads, slots, d}), values({B, kv_heads, slots, dv}),
        valid({B, slots}), counts({B}) {}
  HybridDecodeState<T> state() { return {sums.view(), normaliser.view(), keys.view(), values.view(), valid.view(), counts.view()}; }
};

// The fast state against the float64 reference's: the exact slots, their validity and the counts
// are copies (equal); each of the sums and the normaliser within tol_per_magnitude times the
// reference's magnitude (the sum of its terms' absolute values).
template <class T>
void expect_prefill_state(PrefillRun<T>& got, const reference::HybridPrefillState& want,
                          const reference::HybridPrefillState& magnitude, double tol_per_magnitude) {
  for (int64_t i = 0; i < want.exact_keys.size(); ++i) ASSERT_EQ(double(got.keys[i]), want.exact_keys[i]) << i;
  for (int64_t i = 0; i < want.exact_values.size(); ++i) ASSERT_EQ(double(got.values[i]), want.exact_values[i]) << i;
  for (int64_t i = 0; i < want.exact_valid.size(); ++i) ASSERT_EQ(got.valid[i], want.exact_valid[i]) << i;
  for (int64_t i = 0; i < want.counts.size(); ++i) ASSERT_EQ(got.counts[i], want.counts[i]) << i;
  for (int64_t i = 0; i < want.sums.size(); ++i)
    ASSERT_NEAR(double(got.sums[i]), want.sums[i], tol_per_magnitude * magnitude.sums[i]) << "sums " << i;
  for (int64_t i = 0; i < want.normaliser.size(); ++i)
    ASSERT_NEAR(double(got.normaliser[i]), want.normaliser[i], tol_per_magnitude * magnitude.normaliser[i])
        << "normaliser " << i;
}

// hybrid_prefill with the features given equals reference::hybrid_prefill: a full row and a row
// with padding here and there (holding NaN and inf, which stay out), grouped key heads, windows shorter and longer than the prompt,
// sinks, decay, 1 to 8 threads (below and above B·H = 8). The slots are copies (equal); the sums
// and the normaliser round the decay weight e^{λ·after} (computed in double) once, its product
// with φ once, and sum at most n products: within γ_{n+3} of the sum of the terms' magnitudes.
template <class T>
void check_prefill_given(int64_t window, int64_t sinks, bool decayed, int64_t kv_heads, int threads) {
  SCOPED_TRACE(std::string(dtype_name<T>()) + " w=" + std::to_string(window) + " s=" + std::to_string(sinks) +
               (decayed ? " decay " : " ") + std::to_string(kv_heads) + " key heads, " + std::to_string(threads) +
               " threads");
  testing::ScopedThreads scope(threads);
  constexpr int64_t B = 2, H = 4, n = 29, d = 5, dv = 3, m = 7;
  const Tensor<T> k = random_tensor<T>({B, kv_heads, n, d}, 801), v = random_tensor<T>({B, kv_heads, n, dv}, 802);
  Tensor<T> fk = random_tensor<T>({B, H, n, m}, 803);
  for (int64_t i = 0; i < fk.size(); ++i) fk[i] = std::abs(fk[i]);
  Tensor<bool> valid({B, n});
  for (int64_t p = 0; p < n; ++p) valid[p] = true, valid[n + p] = p % 4 != 1 && p != 0;  // row 1: padding
  Tensor<T> decay({H});
  for (int64_t h = 0; h < H; ++h) decay[h] = static_cast<T>(-0.05 * double(h + 1));
  const TensorView<const T> log_decay = decayed ? TensorView<const T>(decay.view()) : TensorView<const T>{};
  const Tensor<double> decay64 = cast<double>(decay);
  const TensorView<const double> log_decay64 = decayed ? decay64.view() : TensorView<const double>{};
  const Tensor<double> k64 = cast<double>(k), v64 = cast<double>(v), fk64 = cast<double>(fk);
  // Padding may hold anything: NaN and inf at row 1's padded positions, which go nowhere.
  Tensor<T> k_padded = cast<T>(k64), v_padded = cast<T>(v64), fk_padded = cast<T>(fk64);
  for (int64_t p = 0; p < n; ++p) {
    if (valid[n + p]) continue;
    for (int64_t g = kv_heads; g < 2 * kv_heads; ++g) {
      k_padded[(g * n + p) * d] = std::numeric_limits<T>::quiet_NaN();
      v_padded[(g * n + p) * dv + 1] = std::numeric_limits<T>::infinity();
    }
    fk_padded[((H + 1) * n + p) * m] = -std::numeric_limits<T>::infinity();
  }
  for (const bool padded : {false, true}) {
    const TensorView<const bool> marks = padded ? TensorView<const bool>(valid.view()) : TensorView<const bool>{};
    PrefillRun<T> run(B, H, kv_heads, m, sinks + window, d, dv);
    // whatever the state held before is replaced
    std::fill(run.sums.data(), run.sums.data() + run.sums.size(), T(7));
    std::fill(run.valid.data(), run.valid.data() + run.valid.size(), true);
    hybrid_prefill<T>((padded ? k_padded : k).view(), (padded ? v_padded : v).view(), (padded ? fk_padded : fk).view(),
                      marks, log_decay, run.state(), HybridDecodeOptions{window, sinks});
    const auto want = reference::hybrid_prefill(k64.view(), v64.view(), fk64.view(), marks, log_decay64, window, sinks);
    const auto magnitude =
        reference::hybrid_prefill(k64.view(), v64.view(), fk64.view(), marks, log_decay64, window, sinks, true);
    expect_prefill_state(run, want, magnitude, testing::gamma<T>(double(n + 3)));
    EXPECT_EQ(run.counts[0], n);
    if (padded) {
      EXPECT_LT(run.counts[1], n);
    }
  }
}

TEST(HybridPrefill, GivenFeaturesEqualTheReference) {
  for (int threads : {1, 3, 8})
    for (const auto& [w, sinks, decayed] : {std::tuple{0, 0, true}, std::tuple{1, 0, false}, std::tuple{3, 2, true},
                                            std::tuple{8, 0, true}, std::tuple{4, 40, false}, std::tuple{40, 3, true}})
      for (int64_t kv_heads : {int64_t{4}, int64_t{2}, int64_t{1}}) {
        check_prefill_given<float>(w, sinks, decayed, kv_heads, threads);
        check_prefill_given<double>(w, sinks, decayed, kv_heads, threads);
      }
}

// hybrid_prefill applying a map itself (Hedgehog's key map, or a fixed map by name) equals the
// reference given the map's exact features (reference::hedgehog_features, reference::features in
// float64), each query head's map on its key head's keys, with padding, grouped key heads and
// decay. Each fast feature is within ρ·φ of the exact one (Hedgehog: hedgehog_bounds.h's ρ; elu
// 2.6u in float32, 2u in float64; focused γ_{d+8}; relu exact), and the arithmetic adds
// γ_{n+3} as above: tolerance (1.01ρ + γ_{n+3}) times the terms' magnitudes.
template <class T>
void check_prefill_map(const std::string& map, int64_t kv_heads, int threads) {
  SCOPED_TRACE(map + " " + std::string(dtype_name<T>()) + " " + std::to_string(kv_heads) + " key heads, " +
               std::to_string(threads) + " threads");
  testing::ScopedThreads scope(threads);
  const bool hedgehog = map == "hedgehog";
  constexpr int64_t B = 2, H = 6, n = 33, d = 5, dv = 4, f = 3, w = 4, s = 2;
  const int64_t m = hedgehog ? 2 * f : d, G = H / kv_heads;
  const Tensor<T> k = random_tensor<T>({B, kv_heads, n, d}, 811), v = random_tensor<T>({B, kv_heads, n, dv}, 812);
  const Tensor<T> kw = random_tensor<T>({H, d, f}, 813, 0.7), kb = random_tensor<T>({H, f}, 814, 0.3);
  Tensor<bool> valid({B, n});
  for (int64_t p = 0; p < n; ++p) valid[p] = p != 3, valid[n + p] = p % 5 != 2;
  Tensor<T> decay({H});
  for (int64_t h = 0; h < H; ++h) decay[h] = static_cast<T>(-0.02 * double(h));
  Tensor<double> k_per_query({B, H, n, d});  // each query head's copy of its key head's keys
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n * d; ++i) k_per_query[(b * H + h) * n * d + i] = double(k[(b * kv_heads + h / G) * n * d + i]);
  const Tensor<double> kw64 = cast<double>(kw), kb64 = cast<double>(kb);
  constexpr double focus_power = 2.5;
  Tensor<double> fk64;
  if (hedgehog) {
    fk64 = reference::hedgehog_features(k_per_query.view(), kw64.view(), kb64.view());
  } else {
    fk64 = Tensor<double>({B, H, n, m});
    const Tensor<double> rows = reference::features(TensorView<const double>(k_per_query.data(), {B * H * n, d}), map,
                                                    std::nullopt, 1.0, focus_power);
    std::copy(rows.data(), rows.data() + rows.size(), fk64.data());
  }
  const double u = std::ldexp(1.0, -std::numeric_limits<T>::digits);
  const double rho = hedgehog          ? testing::hedgehog_bound<T>(k_per_query, kw64, kb64)
                     : map == "elu"     ? (std::is_same_v<T, float> ? 2.6 : 2.0) * u
                     : map == "focused" ? testing::gamma<T>(static_cast<double>(d + 8))
                                        : 0.0;
  const Tensor<double> k64 = cast<double>(k), v64 = cast<double>(v), decay64 = cast<double>(decay);
  PrefillRun<T> run(B, H, kv_heads, m, s + w, d, dv);
  HybridDecodeOptions opts{w, s};
  if (hedgehog) {
    hybrid_prefill<T>(k.view(), v.view(), kw.view(), kb.view(), valid.view(), decay.view(), run.state(), opts);
  } else {
    opts.feature_map = map, opts.focus_power = focus_power;
    hybrid_prefill<T>(k.view(), v.view(), TensorView<const T>{}, valid.view(), decay.view(), run.state(), opts);
  }
  const auto want = reference::hybrid_prefill(k64.view(), v64.view(), fk64.view(), valid.view(), decay64.view(), w, s);
  const auto magnitude =
      reference::hybrid_prefill(k64.view(), v64.view(), fk64.view(), valid.view(), decay64.view(), w, s, true);
  expect_prefill_state(run, want, magnitude, 1.01 * rho + testing::gamma<T>(double(n + 3)));
}

TEST(HybridPrefill, MapsAppliedByThePrefillEqualTheReference) {
  for (const char* map : {"hedgehog", "elu", "relu", "focused"})
    for (int threads : {1, 3, 16})
      for (int64_t kv_heads : {int64_t{6}, int64_t{2}, int64_t{1}}) {
        check_prefill_map<float>(map, kv_heads, threads);
        check_prefill_map<double>(map, kv_heads, threads);
      }
}

// Bad input: an Error naming the argument, and the state as it was.
TEST(HybridPrefill, BadInputIsAnErrorNamingItAndWritesNothing) {
  using T = float;
  constexpr int64_t B = 2, H = 4, Hkv = 2, n = 9, d = 5, dv = 3, m = 6, f = 3, w = 3, s = 1;
  const Tensor<T> k = random_tensor<T>({B, Hkv, n, d}, 821), v = random_tensor<T>({B, Hkv, n, dv}, 822);
  Tensor<T> fk({B, H, n, m}, false, Init::Zero), kw = random_tensor<T>({H, d, f}, 823), kb({H, f});
  Tensor<T> decay({H});
  PrefillRun<T> run(B, H, Hkv, m, s + w, d, dv);
  std::fill(run.sums.data(), run.sums.data() + run.sums.size(), T(3));
  run.counts[0] = 11;
  const HybridDecodeOptions opts{w, s};
  auto given = [&](TensorView<const T> kk, TensorView<const T> vv, TensorView<const T> features,
                   TensorView<const bool> valid, TensorView<const T> log_decay, const HybridDecodeOptions& o) {
    hybrid_prefill<T>(kk, vv, features, valid, log_decay, run.state(), o);
  };
  const TensorView<const bool> all{};
  const TensorView<const T> none{};
  const Tensor<T> k3({B, 3, n, d}), v_short({B, Hkv, n - 1, dv}), fk_wrong({B, H, n, m + 1});
  testing::expect_error([&] { given(k3.view(), v.view(), fk.view(), all, none, opts); },
                        "hybrid_prefill: k has 3 key/value heads, which must divide the sums' 4 heads");
  testing::expect_error([&] { given(k.view(), v_short.view(), fk.view(), all, none, opts); },
                        "hybrid_prefill: v has shape [2, 2, 8, 3]; expected [2, 2, 9, 3]");
  testing::expect_error([&] { given(k.view(), v.view(), fk_wrong.view(), all, none, opts); },
                        "hybrid_prefill: key_features has shape [2, 4, 9, 7]; expected [2, 4, 9, 6]");
  fk[5] = T(-1);
  testing::expect_error([&] { given(k.view(), v.view(), fk.view(), all, none, opts); },
                        "hybrid_prefill: key_features must be finite and >= 0 at the tokens, got -1 at flat index 5");
  fk[5] = T(0);
  decay[2] = T(0.5);
  testing::expect_error([&] { given(k.view(), v.view(), fk.view(), all, decay.view(), opts); },
                        "hybrid_prefill: log_decay must be finite and <= 0, got 0.5 at flat index 2");
  decay[2] = T(0);
  const Tensor<bool> valid_wrong({B, n + 1});
  testing::expect_error([&] { given(k.view(), v.view(), fk.view(), valid_wrong.view(), none, opts); },
                        "hybrid_prefill: valid has shape [2, 10]; expected [2, 9]");
  testing::expect_error([&] { given(k.view(), v.view(), fk.view(), all, none, HybridDecodeOptions{-1, 0}); },
                        "hybrid_prefill: window must be >= 0, got -1");
  testing::expect_error([&] { given(k.view(), v.view(), fk.view(), all, none, HybridDecodeOptions{0, s}); },
                        "hybrid_prefill: sinks=1 needs window >= 1 (window 0: linear attention alone)");
  Tensor<T> k_nan = random_tensor<T>({B, Hkv, n, d}, 821);
  k_nan[4] = std::numeric_limits<T>::infinity();
  testing::expect_error([&] { given(k_nan.view(), v.view(), fk.view(), all, none, opts); },
                        "hybrid_prefill: k must be finite at its tokens, got inf at [0, 0, 0, 4]");
  HybridDecodeOptions fixed = opts;
  fixed.feature_map = "softmax";
  testing::expect_error([&] { given(k.view(), v.view(), none, all, none, fixed); },
                        "hybrid_prefill: feature_map must be \"elu\", \"relu\", \"focused\" or \"given\"; got \"softmax\"");
  fixed.feature_map = "elu";
  testing::expect_error([&] { given(k.view(), v.view(), fk.view(), all, none, fixed); },
                        "the prefill makes the features itself: key_features must be empty");
  testing::expect_error([&] { given(k.view(), v.view(), none, all, none, fixed); },
                        "hybrid_prefill: sums has 6 features; feature_map=\"elu\" makes 5");
  const Tensor<T> kw4 = random_tensor<T>({H, d, 4}, 824), kb4({H, 4});
  testing::expect_error([&] {
    hybrid_prefill<T>(k.view(), v.view(), kw4.view(), kb4.view(), all, none, run.state(), opts);
  }, "hybrid_prefill: sums has 6 features; Hedgehog's key map of feature_dim 4 makes 8");
  testing::expect_error([&] {
    hybrid_prefill<T>(k.view(), v.view(), kw.view(), kb4.view(), all, none, run.state(), opts);
  }, "hybrid_prefill: key_bias has shape [4, 4]; expected [4, 3]");
  // FAVOR's options and its shifts
  const Tensor<T> projection = random_tensor<T>({3, d}, 825);  // m' = 3 (positive) or 6 (hyperbolic)
  const FavorFeatures<T> favor{projection.view()};
  HybridDecodeOptions favor_opts = opts;
  favor_opts.feature_map = "favor", favor_opts.kernel = "hyperbolic", favor_opts.scale = 0.5;
  Tensor<T> shift({B, H, m});
  HybridDecodeState<T> with_shift = run.state();
  with_shift.shift = shift.view();
  testing::expect_error([&] { hybrid_prefill<T>(k.view(), v.view(), favor, all, none, run.state(), opts); },
                        "hybrid_prefill: FAVOR's projection was given: feature_map must be \"favor\", got \"given\"");
  testing::expect_error([&] { hybrid_prefill<T>(k.view(), v.view(), favor, all, none, run.state(), favor_opts); },
                        "hybrid_prefill: feature_map=\"favor\" keeps its sums in log form: shift [B, H, m'] is required");
  favor_opts.kernel = "trig";
  testing::expect_error([&] { hybrid_prefill<T>(k.view(), v.view(), favor, all, none, with_shift, favor_opts); },
                        "hybrid_prefill: kernel=\"trig\" needs window 0");
  favor_opts.kernel = "positive";
  testing::expect_error([&] { hybrid_prefill<T>(k.view(), v.view(), favor, all, none, with_shift, favor_opts); },
                        "hybrid_prefill: sums has 6 features; FAVOR's kernel=\"positive\" with 3 random features makes 3");
  favor_opts.kernel = "hyperbolic";
  testing::expect_error([&] { hybrid_prefill<T>(k.view(), v.view(), fk.view(), all, none, with_shift, opts); },
                        "hybrid_prefill: shift is FAVOR's (feature_map=\"favor\"); plain features keep none");
  HybridDecodeOptions plain_kernel = opts;
  plain_kernel.kernel = "hyperbolic";
  testing::expect_error([&] { given(k.view(), v.view(), fk.view(), all, none, plain_kernel); },
                        "hybrid_prefill: kernel=\"hyperbolic\" applies to feature_map=\"favor\" only");
  for (int64_t i = 0; i < run.sums.size(); ++i) ASSERT_EQ(run.sums[i], T(3));
  for (int64_t i = 0; i < run.keys.size(); ++i) ASSERT_EQ(run.keys[i], T(0));
  for (int64_t i = 0; i < run.valid.size(); ++i) ASSERT_FALSE(run.valid[i]);
  for (int64_t i = 0; i < shift.size(); ++i) ASSERT_EQ(shift[i], T(0));
  EXPECT_EQ(run.counts[0], 11);
  // a shift of NaN is overwritten, not refused: the prefill writes the state whole
  shift[1] = std::numeric_limits<T>::quiet_NaN();
  PrefillRun<T> favor_run(B, H, Hkv, m, s + w, d, dv);
  HybridDecodeState<T> favor_state = favor_run.state();
  favor_state.shift = shift.view();
  hybrid_prefill<T>(k.view(), v.view(), favor, all, none, favor_state, favor_opts);
  for (int64_t i = 0; i < shift.size(); ++i) ASSERT_TRUE(std::isfinite(shift[i])) << i;
  EXPECT_EQ(favor_run.counts[0], n);
}

}  // namespace
}  // namespace linattn
