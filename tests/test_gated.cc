// Gated linear attention (include/linattn/gated.h) against its float64 recurrence
// (src/linattn/gated/reference.cc) and, for the backward, against central finite differences
// of the forward in float64.
//
// Tolerance of the forward: every output and state value is a sum of terms q·k·v·(decays ≤ 1)
// (and S_0·decays). Whatever the order of summation, the rounding error of such a sum is at
// most γ_m·Σ|terms| (Higham, 3.1), m the longest chain of roundings one term goes through:
// the state carries a term through every chunk (≤ n additions), its product with q adds d_k,
// the intra-chunk products 64 + d_k, and each factor's rounding (e^x, the scaled operands) a
// few more (8). Per channel, a diagonal block's factor e^{b_j − b_i} is a product of at most 15
// per-step factors e^{g_t}, each within 1 ulp (Highway's Exp), and the rows' factors two such
// products: at most 2·16 roundings more, counted in the 8 + 2·16 = 40 below. The decay factors e^{b_j − b_i} come from cumulative sums b (float64) of at most 64
// log-gates: b_j − b_i is off by at most 2·64·u₆₄·max|b|, and e^x by as much relative, which
// matters after a reset (a log-gate at the floor, −1000, makes |b| large while the factors
// after it are O(1)). So |fast − exact| ≤ (2·(n + 2·d_k + 2·64 + 8)·u + 2·64·u₆₄·B)·Σ|terms|,
// with Σ|terms| the same recurrence on |q|, |k|, |v|, |S_0| (reference with absolute = true),
// u the dtype's unit roundoff and B the largest sum of min(|g|, 1000) over a chunk.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <string>
#include <vector>

#include "linattn/gated.h"
#include "linattn/gated/reference.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::random_tensor;

struct Case {
  int64_t batch, heads, n, dk, dv;
  bool per_channel, initial;
  const char* gates;  // testing::log_gates: "mixed", "near0", "resets", "gentle"
};

template <class T>
Tensor<T> gates_for(const Case& c, uint64_t seed) {
  return testing::log_gates<T>(c.per_channel ? Shape{c.batch, c.heads, c.n, c.dk} : Shape{c.batch, c.heads, c.n}, c.gates, seed);
}

template <class T>
Tensor<T> copy_of(const Tensor<T>& t) {
  Tensor<T> c(t.shape());
  std::copy(t.data(), t.data() + t.size(), c.data());
  return c;
}

template <class T>
std::vector<double> widen(const Tensor<T>& t) {
  std::vector<double> out(static_cast<size_t>(t.size()));
  for (int64_t i = 0; i < t.size(); ++i) out[i] = static_cast<double>(t[i]);
  return out;
}

// x·2^e, exact in float32 and float64 (no value leaves the range).
template <class T>
Tensor<T> scaled_by(Tensor<T> x, int e) {
  for (int64_t i = 0; i < x.size(); ++i) x[i] = std::ldexp(x[i], e);
  return x;
}

// Scales q, k, v by 2^e (powers of 2: exact), to reach the range's edges; huge_q_at / huge_k_at
// (flat indices, −1: none) set one entry of q or k to 2^125.
struct Exponents {
  int q = 0, k = 0, v = 0;
  int64_t huge_q_at = -1, huge_k_at = -1;
};

// x with e applied to it (q: which 0, k: which 1).
template <class T>
Tensor<T> edge_input(Tensor<T> x, const Exponents& e, int which) {
  Tensor<T> y = scaled_by(std::move(x), which == 0 ? e.q : e.k);
  const int64_t at = which == 0 ? e.huge_q_at : e.huge_k_at;
  if (at >= 0) y[at] = std::ldexp(T(1), 125);
  return y;
}

// Whether the 64-row chunk holding flat index `at` of a [.., n, dk] tensor takes chunk_decay's
// wide form: every channel's log-gates sum to at least −kWideRange (20) over it.
bool in_wide_chunk(const std::vector<double>& gates, int64_t n, int64_t dk, int64_t width, int64_t at) {
  const int64_t task = at / (n * dk), t0 = (at / dk) % n / 64 * 64;
  for (int64_t c = 0; c < width; ++c) {
    double sum = 0;
    for (int64_t t = t0; t < std::min<int64_t>(t0 + 64, n); ++t) sum += gates[(task * n + t) * width + c];
    if (sum < -20.0) return false;
  }
  return true;
}

template <class T>
void check_forward(const Case& c, int threads, uint64_t seed, Exponents e = {}) {
  SCOPED_TRACE(::testing::Message() << "n=" << c.n << " dk=" << c.dk << " dv=" << c.dv << " per_channel="
                                    << c.per_channel << " initial=" << c.initial << " gates=" << c.gates
                                    << " threads=" << threads << " dtype=" << dtype_name<T>() << " q·2^" << e.q
                                    << " k·2^" << e.k << " v·2^" << e.v);
  testing::ScopedThreads scoped(threads);
  const Tensor<T> q = edge_input(random_tensor<T>({c.batch, c.heads, c.n, c.dk}, seed), e, 0);
  const Tensor<T> k = edge_input(random_tensor<T>({c.batch, c.heads, c.n, c.dk}, seed + 1), e, 1);
  const Tensor<T> v = scaled_by(random_tensor<T>({c.batch, c.heads, c.n, c.dv}, seed + 2), e.v);
  const Tensor<T> g = gates_for<T>(c, seed + 3);
  const Tensor<T> s0 = c.initial ? random_tensor<T>({c.batch, c.heads, c.dk, c.dv}, seed + 4) : Tensor<T>();
  const double scale = 0.7;
  const auto r = gated_linear_attention<T>(q, k, v, g, c.initial ? s0.view() : TensorView<const T>{}, {scale, true});
  const auto qd = widen(q), kd = widen(k), vd = widen(v), gd = widen(g), sd = widen(s0);
  for (int64_t at : {e.huge_q_at, e.huge_k_at}) {  // the entry is where it must make a wide chunk fall back
    if (at >= 0) {
      ASSERT_TRUE(in_wide_chunk(gd, c.n, c.dk, c.per_channel ? c.dk : 1, at)) << at;
    }
  }
  const int64_t bh = c.batch * c.heads;
  const double* init = c.initial ? sd.data() : nullptr;
  const auto want = reference::gated_linear_attention(qd.data(), kd.data(), vd.data(), gd.data(), init, bh, c.n,
                                                      c.dk, c.dv, c.per_channel, scale);
  const auto mag = reference::gated_linear_attention(qd.data(), kd.data(), vd.data(), gd.data(), init, bh, c.n,
                                                     c.dk, c.dv, c.per_channel, scale, true);
  const double u = std::numeric_limits<T>::epsilon() / 2, u64 = std::numeric_limits<double>::epsilon() / 2;
  const int64_t width = c.per_channel ? c.dk : 1;
  double largest_b = 0;  // B: the largest chunk sum of min(|g|, 1000)
  for (int64_t h = 0; h < c.batch * c.heads; ++h)
    for (int64_t e = 0; e < width; ++e)
      for (int64_t t0 = 0; t0 < c.n; t0 += 64) {
        double sum = 0;
        for (int64_t t = t0; t < std::min<int64_t>(t0 + 64, c.n); ++t)
          sum += std::min(std::fabs(gd[(h * c.n + t) * width + e]), 1000.0);
        largest_b = std::max(largest_b, sum);
      }
  // + 2·104·u for float32: its exponents are rounded before exp (|x| <= 104 before e^x underflows)
  const double exponent = std::is_same_v<T, float> ? 2.0 * 104 * u : 0.0;
  const double chain =
      2.0 * static_cast<double>(c.n + 2 * c.dk + 2 * 64 + 40) * u + 2.0 * 64 * u64 * largest_b + exponent;
  ASSERT_EQ(r.out.size(), static_cast<int64_t>(want.out.size()));
  for (int64_t i = 0; i < r.out.size(); ++i)
    ASSERT_LE(std::fabs(static_cast<double>(r.out[i]) - want.out[i]), chain * mag.out[i] + 1e-300) << "out " << i;
  for (int64_t i = 0; i < r.state.size(); ++i)
    ASSERT_LE(std::fabs(static_cast<double>(r.state[i]) - want.state[i]), chain * mag.state[i] + 1e-300)
        << "state " << i;
}

const Case kCases[] = {
    {1, 2, 1, 4, 3, false, false, "mixed"},    {2, 3, 63, 5, 7, true, true, "mixed"},
    {1, 2, 64, 16, 16, true, false, "near0"},  {1, 1, 65, 8, 4, false, true, "near0"},
    {2, 1, 130, 17, 9, true, true, "resets"},  {1, 2, 200, 32, 24, false, false, "resets"},
    {1, 1, 97, 3, 2, true, false, "mixed"},    {1, 2, 300, 16, 8, true, true, "gentle"},
    {2, 1, 64, 5, 3, true, false, "gentle"},   {1, 1, 90, 7, 5, false, true, "gentle"},
};

TEST(GatedLinearAttention, ForwardMatchesTheRecurrenceInFloat64AndFloat32) {
  uint64_t seed = 100;
  for (const Case& c : kCases)
    for (int threads : {1, 3, 8}) {
      check_forward<double>(c, threads, seed);
      check_forward<float>(c, threads, seed);
      seed += 10;
    }
}

// Per channel, a chunk whose gates decay little is one product of rows scaled up and down by up
// to e^{R/2} (src/linattn/core/chunk_decay.h, kWideRange). float32 q near 2^120 with an entry of
// 2^125 in the first row of a wide chunk (U_0 ≈ e^{4.7} takes it past 2^128), or k likewise in
// the last row (W_{L−1} ≈ e^{4.8}), overflows those operands though every result is finite: the
// chunk must take the blocked form, and the result stay within the same bound. (Rows 128 and
// 191 of head 0 are chunk 2, which holds no −30 of the "gentle" gates: checked.)
TEST(GatedLinearAttention, WideChunksWhoseOperandsOverflowTakeTheBlockedForm) {
  uint64_t seed = 900;
  const Case c{1, 2, 300, 16, 8, true, true, "gentle"};
  for (int threads : {1, 3}) {
    check_forward<float>(c, threads, seed, {120, -20, -60, 128 * 16, -1});
    check_forward<float>(c, threads, seed + 5, {-20, 120, -60, -1, 191 * 16});
    seed += 10;
  }
}

// The diagonal blocks' and the rows' factors run on Highway (simd::decay_pairs, decayed_dots,
// decayed_weigh, multiply): every instruction set this CPU has, against the same bound.

TEST(GatedLinearAttention, EverySimdTargetMatchesTheRecurrence) {
  uint64_t seed = 700;
  testing::for_each_simd_target([&](int64_t) {
    for (const Case& c : {Case{1, 2, 130, 17, 9, true, true, "mixed"}, Case{1, 1, 97, 5, 3, false, false, "resets"},
                          Case{1, 2, 200, 17, 9, true, true, "gentle"}}) {
      check_forward<double>(c, 2, seed);
      check_forward<float>(c, 2, seed);
      seed += 10;
    }
  });
}

TEST(GatedLinearAttention, EveryThreadCountGivesTheSameBits) {
  // One (batch, head) per task: 1 to 16 threads, above and below batch·heads (1 to 3), give
  // the same outputs, state and gradients bit for bit.
  struct Form {
    bool per_channel;
    const char* gates;
  };
  for (int64_t heads : {1, 3})
    for (const Form& form : {Form{false, "resets"}, Form{true, "resets"}, Form{false, "gentle"}, Form{true, "gentle"}}) {
      const Case c{1, heads, 150, 8, 6, form.per_channel, true, form.gates};
      const auto q = random_tensor<float>({1, heads, 150, 8}, 1), k = random_tensor<float>({1, heads, 150, 8}, 2);
      const auto v = random_tensor<float>({1, heads, 150, 6}, 3), s0 = random_tensor<float>({1, heads, 8, 6}, 4);
      const auto dout = random_tensor<float>({1, heads, 150, 6}, 5);
      const auto g = gates_for<float>(c, 6);
      testing::expect_same_bits_for_threads({1, 3, 8, 16}, [&] {
        auto r = gated_linear_attention<float>(q, k, v, g, s0.view());
        auto gr = gated_linear_attention_backward<float>(q, k, v, g, s0.view(), dout, {});
        std::vector<std::pair<std::string, Tensor<float>>> named;
        named.emplace_back("out", std::move(r.out));
        named.emplace_back("state", std::move(r.state));
        named.emplace_back("dq", std::move(gr.dq));
        named.emplace_back("dk", std::move(gr.dk));
        named.emplace_back("dv", std::move(gr.dv));
        named.emplace_back("dlog_gate", std::move(gr.dlog_gate));
        named.emplace_back("dinitial_state", std::move(gr.dinitial_state));
        return named;
      });
    }
}

TEST(GatedLinearAttention, TwoCallsOverASplitEqualOneCall) {
  for (bool per_channel : {false, true}) {
    const Case c{1, 2, 150, 6, 5, per_channel, true, "mixed"};
    const Tensor<double> q = random_tensor<double>({1, 2, 150, 6}, 1), k = random_tensor<double>({1, 2, 150, 6}, 2);
    const Tensor<double> v = random_tensor<double>({1, 2, 150, 5}, 3), s0 = random_tensor<double>({1, 2, 6, 5}, 4);
    const Tensor<double> g = gates_for<double>(c, 5);
    const auto whole = gated_linear_attention<double>(q, k, v, g, s0.view());
    const int64_t cut = 77;  // not a multiple of the chunk
    auto slice = [&](const Tensor<double>& x, int64_t from, int64_t to) {
      const int64_t inner = x.rank() == 4 ? x.dim(3) : 1;
      Shape shape = x.shape();
      shape[2] = to - from;
      Tensor<double> y(shape);
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t t = from; t < to; ++t)
          for (int64_t e = 0; e < inner; ++e) y[(h * (to - from) + t - from) * inner + e] = x[(h * 150 + t) * inner + e];
      return y;
    };
    const auto first = gated_linear_attention<double>(slice(q, 0, cut), slice(k, 0, cut), slice(v, 0, cut),
                                                      slice(g, 0, cut), s0.view());
    const auto second = gated_linear_attention<double>(slice(q, cut, 150), slice(k, cut, 150), slice(v, cut, 150),
                                                       slice(g, cut, 150), first.state.view());
    const Tensor<double> out_a = slice(whole.out, 0, cut), out_b = slice(whole.out, cut, 150);
    for (int64_t i = 0; i < out_a.size(); ++i) ASSERT_NEAR(first.out[i], out_a[i], 1e-12 * (1 + std::fabs(out_a[i])));
    for (int64_t i = 0; i < out_b.size(); ++i) ASSERT_NEAR(second.out[i], out_b[i], 1e-12 * (1 + std::fabs(out_b[i])));
    for (int64_t i = 0; i < whole.state.size(); ++i)
      ASSERT_NEAR(second.state[i], whole.state[i], 1e-12 * (1 + std::fabs(whole.state[i])));
  }
}

// L = Σ w_o·out + Σ w_s·state, in float64.
struct Loss {
  Tensor<double> w_out, w_state;
  double operator()(const GatedLinearAttentionResult<double>& r) const {
    double l = 0;
    for (int64_t i = 0; i < r.out.size(); ++i) l += w_out[i] * r.out[i];
    for (int64_t i = 0; i < r.state.size(); ++i) l += w_state[i] * r.state[i];
    return l;
  }
};

struct GradCase {
  int64_t n, dk, dv;
  bool per_channel;
  const char* gates;
  bool initial, with_dstate;
};

// Every entry of x against central differences of loss() (h = 1e−5; for a log-gate at most half
// its distance to 0, and none at or below the floor, where the gradient must be 0), to 1e−7 of
// the largest gradient.
template <class Loss>
void expect_differences(const char* name, Tensor<double>& x, const Tensor<double>& grad, Loss loss) {
  double largest = 0;
  for (int64_t i = 0; i < grad.size(); ++i) largest = std::max(largest, std::fabs(grad[i]));
  ASSERT_GT(largest, 0) << name;
  const bool gate = std::string(name) == "log_gate";
  for (int64_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    if (gate && !(saved > -1000.0)) {  // at the floor (or −inf): no gradient
      ASSERT_EQ(grad[i], 0.0) << name << " " << i;
      continue;
    }
    const double h = gate ? std::min(1e-5, -saved / 2) : 1e-5;
    x[i] = saved + h;
    const double up = loss();
    x[i] = saved - h;
    const double down = loss();
    x[i] = saved;
    ASSERT_NEAR(grad[i], (up - down) / (2 * h), 1e-7 * largest + 1e-9) << name << " " << i;
  }
}

TEST(GatedLinearAttention, EveryGradientMatchesCentralDifferencesInFloat64) {
  // Central differences with h = 1e−5 on a loss of size O(1): truncation h²·|L‴| ~ 1e−10 and
  // cancellation u·|L|/h ~ 1e−11; the gradients agree to 1e−7 relative to the largest. Sizes
  // give a last chunk of 6 and of 37 rows (partial blocks of 16), d_k or d_v of 1, and calls
  // without an initial state or without the state's gradient.
  const GradCase cases[] = {{70, 3, 2, false, "mixed", true, true},   {70, 3, 2, true, "mixed", true, true},
                            {70, 3, 2, false, "resets", true, true},  {70, 3, 2, true, "resets", true, true},
                            {101, 2, 3, false, "mixed", false, true}, {101, 2, 3, true, "mixed", true, false},
                            {37, 1, 4, true, "mixed", false, false},  {37, 4, 1, false, "resets", true, true},
                            {70, 3, 2, true, "gentle", true, true},   {101, 2, 3, true, "gentle", false, true}};
  for (const GradCase& gc : cases) {
    SCOPED_TRACE(::testing::Message() << "n=" << gc.n << " dk=" << gc.dk << " dv=" << gc.dv << " per_channel="
                                      << gc.per_channel << " gates=" << gc.gates << " initial=" << gc.initial
                                      << " dstate=" << gc.with_dstate);
    const Case c{1, 2, gc.n, gc.dk, gc.dv, gc.per_channel, gc.initial, gc.gates};
    Tensor<double> q = random_tensor<double>({1, 2, gc.n, gc.dk}, 11), k = random_tensor<double>({1, 2, gc.n, gc.dk}, 12);
    Tensor<double> v = random_tensor<double>({1, 2, gc.n, gc.dv}, 13), s0 = random_tensor<double>({1, 2, gc.dk, gc.dv}, 14);
    Tensor<double> g = gates_for<double>(c, 15);
    Loss loss{random_tensor<double>({1, 2, gc.n, gc.dv}, 16), random_tensor<double>({1, 2, gc.dk, gc.dv}, 17)};
    if (!gc.with_dstate) loss.w_state = Tensor<double>({1, 2, gc.dk, gc.dv});  // zeros: the state unused
    const GatedLinearAttentionOptions opts{0.6, true};
    auto init = [&] { return gc.initial ? s0.view() : TensorView<const double>{}; };
    const auto grads = gated_linear_attention_backward<double>(
        q, k, v, g, init(), loss.w_out.view(), gc.with_dstate ? loss.w_state.view() : TensorView<const double>{}, opts);
    struct Input {
      const char* name;
      Tensor<double>* x;
      const Tensor<double>* grad;
    };
    std::vector<Input> inputs = {{"q", &q, &grads.dq}, {"k", &k, &grads.dk}, {"v", &v, &grads.dv},
                                 {"log_gate", &g, &grads.dlog_gate}};
    if (gc.initial) inputs.push_back({"initial_state", &s0, &grads.dinitial_state});
    for (const Input& in : inputs)
      expect_differences(in.name, *in.x, *in.grad,
                         [&] { return loss(gated_linear_attention<double>(q, k, v, g, init(), opts)); });
  }
}

// causal = false: the causal form plus its mirror (src/linattn/gated/gated.cc), against the
// O(n²) definition (reference::gated_linear_attention_noncausal). Each half is within the chain
// bound of its own terms' magnitudes (the terms s <= t, and s >= t); together they count the
// diagonal twice and subtract it once (a product of d_k + 2 roundings, < the chain's count):
// |fast − exact| <= chain·(Σ|terms| + 2·|diagonal|) <= 3·chain·Σ|terms|.
TEST(GatedLinearAttention, NonCausalMatchesItsDefinition) {
  uint64_t seed = 1300;
  for (const Case& c : {Case{2, 2, 150, 5, 3, false, false, "mixed"}, Case{1, 2, 130, 17, 9, true, false, "mixed"},
                        Case{1, 1, 97, 4, 6, true, false, "resets"}, Case{1, 2, 64, 3, 2, false, false, "resets"},
                        Case{1, 1, 1, 2, 2, true, false, "near0"}})
    for (int threads : {1, 3}) {
      testing::ScopedThreads scoped(threads);
      const auto q = random_tensor<double>({c.batch, c.heads, c.n, c.dk}, seed);
      const auto k = random_tensor<double>({c.batch, c.heads, c.n, c.dk}, seed + 1);
      const auto v = random_tensor<double>({c.batch, c.heads, c.n, c.dv}, seed + 2);
      const auto g = gates_for<double>(c, seed + 3);
      const auto qd = widen(q), kd = widen(k), vd = widen(v), gd = widen(g);
      const int64_t bh = c.batch * c.heads;
      const auto want = reference::gated_linear_attention_noncausal(qd.data(), kd.data(), vd.data(), gd.data(), bh,
                                                                    c.n, c.dk, c.dv, c.per_channel, 0.7);
      const auto mag = reference::gated_linear_attention_noncausal(qd.data(), kd.data(), vd.data(), gd.data(), bh,
                                                                   c.n, c.dk, c.dv, c.per_channel, 0.7, true);
      double largest_b = 0;
      for (int64_t i = 0; i < g.size(); ++i) largest_b = std::max(largest_b, std::fabs(gd[i]));
      largest_b = std::min(largest_b, 1000.0) * 64;
      for (const bool as_float : {false, true}) {
        const double u = as_float ? std::numeric_limits<float>::epsilon() / 2 : std::numeric_limits<double>::epsilon() / 2;
        const double chain = 2.0 * static_cast<double>(c.n + 2 * c.dk + 2 * 64 + 40) * u +
                             2.0 * 64 * (std::numeric_limits<double>::epsilon() / 2) * largest_b +
                             (as_float ? 2.0 * 104 * u : 0.0);
        std::vector<double> got;
        if (as_float)
          got = widen(gated_linear_attention<float>(testing::cast<float>(q), testing::cast<float>(k),
                                                    testing::cast<float>(v), testing::cast<float>(g), {},
                                                    {0.7, false}).out);
        else
          got = widen(gated_linear_attention<double>(q, k, v, g, {}, {0.7, false}).out);
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_LE(std::fabs(got[i] - want[i]), 3 * chain * mag[i] + 1e-300)
              << "out " << i << " n " << c.n << " float " << as_float << " threads " << threads;
      }
      seed += 10;
    }
}

TEST(GatedLinearAttention, NonCausalGradientsMatchCentralDifferences) {
  // As EveryGradientMatchesCentralDifferencesInFloat64: h = 1e−5, agreement to 1e−7 of the largest.
  for (const bool per_channel : {false, true})
    for (const char* gates : {"mixed", "resets"}) {
      SCOPED_TRACE(::testing::Message() << "per_channel " << per_channel << " gates " << gates);
      const Case c{1, 2, 70, 3, 2, per_channel, false, gates};
      Tensor<double> q = random_tensor<double>({1, 2, 70, 3}, 21), k = random_tensor<double>({1, 2, 70, 3}, 22);
      Tensor<double> v = random_tensor<double>({1, 2, 70, 2}, 23), g = gates_for<double>(c, 24);
      const Tensor<double> w = random_tensor<double>({1, 2, 70, 2}, 25);
      const GatedLinearAttentionOptions opts{0.6, false};
      auto loss = [&] {
        const auto r = gated_linear_attention<double>(q, k, v, g, {}, opts);
        double l = 0;
        for (int64_t i = 0; i < w.size(); ++i) l += w[i] * r.out[i];
        return l;
      };
      const auto grads = gated_linear_attention_backward<double>(q, k, v, g, {}, w, {}, opts);
      struct Input {
        const char* name;
        Tensor<double>* x;
        const Tensor<double>* grad;
      };
      for (const Input& in : {Input{"q", &q, &grads.dq}, Input{"k", &k, &grads.dk}, Input{"v", &v, &grads.dv},
                              Input{"log_gate", &g, &grads.dlog_gate}})
        expect_differences(in.name, *in.x, *in.grad, loss);
    }
}

TEST(GatedLinearAttention, AnEmptySequencePassesTheStatesGradientThrough) {
  const Tensor<double> q({1, 2, 0, 4}), v({1, 2, 0, 3}), g({1, 2, 0}), dout({1, 2, 0, 3});
  const auto s0 = random_tensor<double>({1, 2, 4, 3}, 1), ds = random_tensor<double>({1, 2, 4, 3}, 2);
  const auto grads = gated_linear_attention_backward<double>(q, q, v, g, s0.view(), dout, ds.view());
  for (int64_t i = 0; i < ds.size(); ++i) EXPECT_EQ(grads.dinitial_state[i], ds[i]);
}

TEST(GatedLinearAttention, Float32GradientsFollowFloat64) {
  // dq, dk, dv and dS_0 are sums of products of q, k, v, dout, dstate, S_0 and decays, as the
  // forward's values are: the chain bound applies with Σ|terms| = the float64 backward on
  // absolute values (mag). The gates' gradient is a reverse sum over the chunk of
  // db_j = q_j ⊙ dq_j − k_j ⊙ dk_j, plus at the chunk's end Σ_i k_i ⊙ dk^{state}_i (at most
  // Σ_i |k_i|·mag.dk_i) and e^{b_L} ⊙ Σ_f G·P, of magnitude at most Σ_f |G|·|P| with |P| the
  // absolute forward's state at the chunk's start and |G| the absolute backward's initial-state
  // gradient of the rest of the sequence. So, per element, the chain bound times
  // Σ_{j>=t in the chunk} (|q_j|·mag.dq_j + |k_j|·mag.dk_j) + Σ_{chunk} |k|·mag.dk + Σ_f |G||P|
  // (summed over the channels for a per-head gate).
  // The last two: float32 q or k near 2^120 with an entry of 2^125 in the first (q) or last (k)
  // row of head 0's chunk 1, a wide chunk (chunk_decay.h), whose scaled operands overflow so
  // that it takes the blocked form, in the scores and in both weighings of the backward.
  struct Variant {
    const char* gates;
    Exponents e;
  };
  for (bool per_channel : {false, true})
    for (const Variant& variant : {Variant{"mixed", {}}, Variant{"resets", {}}, Variant{"gentle", {}},
                                   Variant{"gentle", {120, -20, -60, 64 * 12, -1}},
                                   Variant{"gentle", {-20, 120, -60, -1, 127 * 12}}}) {
      const char* gates = variant.gates;
      SCOPED_TRACE(::testing::Message() << "per_channel=" << per_channel << " gates=" << gates << " q·2^"
                                        << variant.e.q << " k·2^" << variant.e.k);
      const int64_t B = 2, H = 2, n = 140, dk = 12, dv = 10, bh = B * H;
      const Case c{B, H, n, dk, dv, per_channel, true, gates};
      const auto q = edge_input(random_tensor<double>({B, H, n, dk}, 21), variant.e, 0);
      const auto k = edge_input(random_tensor<double>({B, H, n, dk}, 22), variant.e, 1);
      const auto v = scaled_by(random_tensor<double>({B, H, n, dv}, 23), variant.e.v);
      const auto s0 = random_tensor<double>({B, H, dk, dv}, 24);
      const auto g = gates_for<double>(c, 25);
      for (int64_t at : {variant.e.huge_q_at, variant.e.huge_k_at}) {
        if (at >= 0) {
          ASSERT_TRUE(in_wide_chunk(widen(g), n, dk, per_channel ? dk : 1, at)) << at;
        }
      }
      const auto dout = random_tensor<double>({B, H, n, dv}, 26), dstate = random_tensor<double>({B, H, dk, dv}, 27);
      auto absolute = [](const Tensor<double>& x) {
        Tensor<double> y(x.shape());
        for (int64_t i = 0; i < x.size(); ++i) y[i] = std::fabs(x[i]);
        return y;
      };
      auto rows = [&](const Tensor<double>& x, int64_t from, int64_t to) {  // positions [from, to)
        const int64_t inner = x.rank() == 4 ? x.dim(3) : 1;
        Shape shape = x.shape();
        shape[2] = to - from;
        Tensor<double> y(shape);
        for (int64_t h = 0; h < bh; ++h)
          for (int64_t t = from; t < to; ++t)
            for (int64_t e = 0; e < inner; ++e) y[(h * (to - from) + t - from) * inner + e] = x[(h * n + t) * inner + e];
        return y;
      };
      const auto wide = gated_linear_attention_backward<double>(q, k, v, g, s0.view(), dout.view(), dstate.view());
      const auto aq = absolute(q), ak = absolute(k), av = absolute(v), as0 = absolute(s0), ado = absolute(dout),
                 ads = absolute(dstate);
      const auto mag = gated_linear_attention_backward<double>(aq, ak, av, g, as0.view(), ado.view(), ads.view());
      const int64_t width = per_channel ? dk : 1;
      Tensor<double> bound({B, H, n, width});  // Σ|terms| of each gate gradient
      for (int64_t t0 = 0; t0 < n; t0 += 64) {
        const int64_t t1 = std::min<int64_t>(t0 + 64, n);
        const auto P = gated_linear_attention<double>(rows(aq, 0, t0), rows(ak, 0, t0), rows(av, 0, t0),
                                                      rows(g, 0, t0), as0.view());  // |state| at the chunk's start
        const auto rest = gated_linear_attention_backward<double>(  // |G| after the chunk
            rows(aq, t1, n), rows(ak, t1, n), rows(av, t1, n), rows(g, t1, n), P.state.view(), rows(ado, t1, n),
            ads.view());
        for (int64_t h = 0; h < bh; ++h)
          for (int64_t e = 0; e < dk; ++e) {
            double end = 0;
            for (int64_t f = 0; f < dv; ++f)
              end += rest.dinitial_state[(h * dk + e) * dv + f] * P.state[(h * dk + e) * dv + f];
            for (int64_t t = t0; t < t1; ++t) end += ak[(h * n + t) * dk + e] * mag.dk[(h * n + t) * dk + e];
            double acc = end;
            for (int64_t t = t1 - 1; t >= t0; --t) {
              const int64_t i = (h * n + t) * dk + e;
              acc += aq[i] * mag.dq[i] + ak[i] * mag.dk[i];
              bound[(h * n + t) * width + (per_channel ? e : 0)] += acc;
            }
          }
      }
      const double u = std::numeric_limits<float>::epsilon() / 2;
      // + 2·104·u: a float32 exponent is rounded before exp (|x| <= 104 before e^x underflows)
      const double chain = 2.0 * (n + 2 * dk + 2 * 64 + 8 + 104) * u;
      for (int threads : {1, 3, 16}) {
        testing::ScopedThreads scoped(threads);
        const auto narrow = gated_linear_attention_backward<float>(
            testing::cast<float>(q), testing::cast<float>(k), testing::cast<float>(v), testing::cast<float>(g),
            testing::cast<float>(s0).view(), testing::cast<float>(dout).view(), testing::cast<float>(dstate).view());
        auto compare = [&](const char* name, const Tensor<double>& a, const Tensor<float>& b, const Tensor<double>& m) {
          for (int64_t i = 0; i < a.size(); ++i)
            ASSERT_LE(std::fabs(a[i] - static_cast<double>(b[i])), chain * m[i] + 1e-30)
                << name << " " << i << " threads " << threads;
        };
        compare("dq", wide.dq, narrow.dq, mag.dq);
        compare("dk", wide.dk, narrow.dk, mag.dk);
        compare("dv", wide.dv, narrow.dv, mag.dv);
        compare("dinitial_state", wide.dinitial_state, narrow.dinitial_state, mag.dinitial_state);
        compare("dlog_gate", wide.dlog_gate, narrow.dlog_gate, bound);
      }
    }
}

TEST(GatedLinearAttention, BadInputIsAnErrorNamingTheArgument) {
  const auto q = random_tensor<float>({1, 2, 8, 4}, 1), v = random_tensor<float>({1, 2, 8, 3}, 2);
  Tensor<float> g({1, 2, 8});
  const auto fails = [](auto&& call, const std::string& text) { testing::expect_error(call, text); };
  fails([&] { gated_linear_attention<float>(q, q, v, random_tensor<float>({1, 2, 7}, 3), {}); }, "log_gate has shape");
  Tensor<float> positive({1, 2, 8});
  positive[5] = 0.5f;
  fails([&] { gated_linear_attention<float>(q, q, v, positive, {}); }, "log_gate must be <= 0");
  Tensor<float> nan({1, 2, 8});
  nan[2] = std::numeric_limits<float>::quiet_NaN();
  fails([&] { gated_linear_attention<float>(q, q, v, nan, {}); }, "log_gate must be <= 0");
  Tensor<float> bad_q = random_tensor<float>({1, 2, 8, 4}, 4);
  bad_q[9] = std::numeric_limits<float>::infinity();
  fails([&] { gated_linear_attention<float>(bad_q, q, v, g, {}); }, "q has a non-finite value");
  fails([&] { gated_linear_attention<float>(q, bad_q, v, g, {}); }, "k has a non-finite value");
  Tensor<float> bad_v = random_tensor<float>({1, 2, 8, 3}, 8);
  bad_v[4] = std::numeric_limits<float>::quiet_NaN();
  fails([&] { gated_linear_attention<float>(q, q, bad_v, g, {}); }, "v has a non-finite value");
  fails([&] { gated_linear_attention<float>(q, random_tensor<float>({1, 2, 8, 5}, 5), v, g, {}); }, "k has shape");
  fails([&] { gated_linear_attention<float>(q, q, v, g, random_tensor<float>({1, 2, 3, 4}, 6).view()); },
        "initial_state has shape");
  fails([&] { gated_linear_attention<float>(q, q, v, g, random_tensor<float>({1, 2, 4, 3}, 9).view(), {std::nullopt, false}); },
        "initial_state must be None with causal=false");
  fails([&] { gated_linear_attention_backward<float>(q, q, v, g, {}, v, random_tensor<float>({1, 2, 4, 3}, 9).view(),
                                                     {std::nullopt, false}); },
        "dstate must be None with causal=false");
  fails([&] { gated_linear_attention<float>(q, q, v, g, {}, {std::numeric_limits<double>::infinity(), true}); },
        "scale must be finite");
  fails([&] { gated_linear_attention_backward<float>(q, q, v, g, {}, random_tensor<float>({1, 2, 8, 4}, 7), {}); },
        "dout has shape");
}

// The checks ride on the computation (src/linattn/gated/gated.cc): a non-finite value anywhere
// in any input, in either gate form, forward or backward, is an error naming that input, and so
// is a bad log-gate in any chunk.
TEST(GatedLinearAttention, ANonFiniteInputAnywhereIsNamed) {
  const int64_t B = 2, H = 2, n = 150, dk = 5, dv = 3;
  const double bad_values[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                               -std::numeric_limits<double>::infinity()};
  uint64_t seed = 900;
  for (const bool per_channel : {false, true}) {
    const auto q = random_tensor<double>({B, H, n, dk}, seed), k = random_tensor<double>({B, H, n, dk}, seed + 1);
    const auto v = random_tensor<double>({B, H, n, dv}, seed + 2), s0 = random_tensor<double>({B, H, dk, dv}, seed + 3);
    const auto dout = random_tensor<double>({B, H, n, dv}, seed + 4), ds = random_tensor<double>({B, H, dk, dv}, seed + 5);
    Tensor<double> g = random_tensor<double>(per_channel ? Shape{B, H, n, dk} : Shape{B, H, n}, seed + 6);
    for (int64_t i = 0; i < g.size(); ++i) g[i] = -std::fabs(g[i]);
    struct Arg {
      const char* name;
      const Tensor<double>* tensor;
    };
    for (const Arg& a : {Arg{"q", &q}, Arg{"k", &k}, Arg{"v", &v}, Arg{"initial_state", &s0}, Arg{"dout", &dout},
                         Arg{"dstate", &ds}})
      for (int trial = 0; trial < 6; ++trial) {
        Tensor<double> bad = copy_of(*a.tensor);
        const int64_t at = static_cast<int64_t>((seed * 2654435761u + trial * 40503u) % static_cast<uint64_t>(bad.size()));
        bad[at] = bad_values[trial % 3];
        auto pick = [&](const Tensor<double>& t) { return &t == a.tensor ? bad.view() : t.view(); };
        const std::string want = std::string(a.name) + " has a non-finite value";
        SCOPED_TRACE(want + " at " + std::to_string(at) + (per_channel ? " per channel" : " per head"));
        const bool backward_only = a.tensor == &dout || a.tensor == &ds;
        if (!backward_only) {
          try {
            gated_linear_attention<double>(pick(q), pick(k), pick(v), g, pick(s0));
            ADD_FAILURE() << "no error";
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
          }
        }
        try {
          gated_linear_attention_backward<double>(pick(q), pick(k), pick(v), g, pick(s0), pick(dout), pick(ds));
          ADD_FAILURE() << "no error";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
        }
        ++seed;
      }
    for (int trial = 0; trial < 4; ++trial) {  // a bad log-gate in any chunk
      Tensor<double> bad = copy_of(g);
      const int64_t at = static_cast<int64_t>((seed * 2654435761u) % static_cast<uint64_t>(bad.size()));
      bad[at] = trial % 2 ? 1e-3 : std::numeric_limits<double>::quiet_NaN();
      for (const bool backward : {false, true})
        try {
          if (backward)
            gated_linear_attention_backward<double>(q, k, v, bad, s0.view(), dout.view(), ds.view());
          else
            gated_linear_attention<double>(q, k, v, bad, s0.view());
          ADD_FAILURE() << "no error for a log-gate at " << at;
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("log_gate must be <= 0"), std::string::npos) << e.what();
        }
      ++seed;
    }
  }
}

// With scale = 0 no q reaches a result, so the inputs are scanned before; finite inputs whose
// products leave float32's range are an error saying so, never a silent inf.
TEST(GatedLinearAttention, ZeroScaleStillChecksAndOverflowIsAnError) {
  auto q = random_tensor<float>({1, 1, 70, 4}, 1);
  const auto v = random_tensor<float>({1, 1, 70, 3}, 2);
  const Tensor<float> g({1, 1, 70});
  Tensor<float> bad_q = copy_of(q);
  bad_q[200] = std::numeric_limits<float>::quiet_NaN();
  try {
    gated_linear_attention<float>(bad_q, q, v, g, {}, {0.0, true});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q has a non-finite value"), std::string::npos) << e.what();
  }
  for (int64_t i = 0; i < q.size(); ++i) q[i] = 1e20f;
  try {
    gated_linear_attention<float>(q, q, v, g, {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("overflows float32"), std::string::npos) << e.what();
  }
}

TEST(GatedLinearAttention, AnEmptySequenceHandsBackTheInitialState) {
  const Tensor<double> q({1, 2, 0, 4}), v({1, 2, 0, 3}), g({1, 2, 0});
  const auto s0 = random_tensor<double>({1, 2, 4, 3}, 1);
  const auto r = gated_linear_attention<double>(q, q, v, g, s0.view());
  EXPECT_EQ(r.out.size(), 0);
  for (int64_t i = 0; i < s0.size(); ++i) EXPECT_EQ(r.state[i], s0[i]);
}

}  // namespace
}  // namespace linattn
