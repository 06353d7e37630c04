// Exact softmax attention: fast path against the float64 reference and against derived
// error bounds, gradients against finite differences, masks, threads, memory, bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <limits>
#include <tuple>

#include "linattn/softmax.h"
#include "linattn/softmax/forward_internal.h"
#include "linattn/softmax/reference.h"
#include "softmax_bounds.h"
#include "test_util.h"

namespace linattn {
namespace {

using ::testing::HasSubstr;
using testing::cast;
using testing::error_of;
using testing::expect_within;
using testing::random_tensor;
using testing::ScopedThreads;

enum class Mask { None, Causal, KeyLengths, CausalKeyLengths };
const char* mask_name(Mask m) {
  switch (m) {
    case Mask::None: return "none";
    case Mask::Causal: return "causal";
    case Mask::KeyLengths: return "key_lengths";
    case Mask::CausalKeyLengths: return "causal+key_lengths";
  }
  return "?";
}

AttentionOptions options_for(Mask m, int64_t batch, int64_t n_k, uint64_t seed) {
  AttentionOptions o;
  o.causal = m == Mask::Causal || m == Mask::CausalKeyLengths;
  if (m == Mask::KeyLengths || m == Mask::CausalKeyLengths) {
    std::vector<int64_t> lengths;
    Rng rng(seed);
    // Item 0 keeps every key, item 1 none (all its rows see nothing), others a random length.
    for (int64_t b = 0; b < batch; ++b)
      lengths.push_back(b == 0 ? n_k : b == 1 ? 0 : int64_t(rng.uniform() * (n_k + 1)) % (n_k + 1));
    o.key_lengths = lengths;
  }
  return o;
}

struct Case {
  int64_t n_q, n_k, d, dv;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "n_q=" << c.n_q << " n_k=" << c.n_k << " d=" << c.d << " d_v=" << c.dv;
}
void PrintTo(Mask m, std::ostream* os) { *os << mask_name(m); }

// Fast float32 and float64 paths, forward and backward, 1, 2 and 7 threads, every mask, against
// the exact values within the bounds of softmax_bounds.h.
class SoftmaxVsExact : public ::testing::TestWithParam<std::tuple<Case, Mask>> {};

template <class T>
void check_case(const Case& c, Mask m, uint64_t seed) {
  const int64_t B = 3, H = 2;
  const auto q = random_tensor<double>({B, H, c.n_q, c.d}, seed);
  const auto k = random_tensor<double>({B, H, c.n_k, c.d}, seed + 1);
  const auto v = random_tensor<double>({B, H, c.n_k, c.dv}, seed + 2);
  const auto dout = random_tensor<double>({B, H, c.n_q, c.dv}, seed + 3);
  const AttentionOptions opts = options_for(m, B, c.n_k, seed);
  // Inputs rounded to T first: the bounds cover the arithmetic, not the input rounding.
  const auto qt = cast<T>(q), kt = cast<T>(k), vt = cast<T>(v), dt = cast<T>(dout);
  const auto exact = testing::softmax_exact_with_bounds<T>(cast<double>(qt), cast<double>(kt),
                                                           cast<double>(vt), cast<double>(dt), opts);
  // Below and above batch·heads (6).
  for (int threads : {1, 2, 7}) {
    SCOPED_TRACE(::testing::Message() << "threads=" << threads << " mask=" << mask_name(m)
                                      << " n_q=" << c.n_q << " n_k=" << c.n_k << " d=" << c.d
                                      << " dv=" << c.dv << " T=" << sizeof(T) * 8 << "-bit");
    ScopedThreads scope(threads);
    const auto f = softmax_attention<T>(qt, kt, vt, opts);
    expect_within(f.out, exact.out, exact.out_bound, "out");
    for (int64_t i = 0; i < f.lse.size(); ++i) {
      if (std::isinf(exact.lse[i])) {
        EXPECT_EQ(f.lse[i], -std::numeric_limits<T>::infinity()) << "lse[" << i << "]";
      } else {
        EXPECT_NEAR(f.lse[i], exact.lse[i], exact.lse_bound[i]) << "lse[" << i << "]";
      }
    }
    const auto g = softmax_attention_backward<T>(qt, kt, vt, dt, f.out, f.lse, opts);
    expect_within(g.dq, exact.dq, exact.dq_bound, "dq");
    expect_within(g.dk, exact.dk, exact.dk_bound, "dk");
    expect_within(g.dv, exact.dv, exact.dv_bound, "dv");
  }
}

TEST_P(SoftmaxVsExact, Float32) {
  const auto [c, m] = GetParam();
  check_case<float>(c, m, 100 + c.n_q * 7 + c.d);
}

TEST_P(SoftmaxVsExact, Float64) {
  const auto [c, m] = GetParam();
  check_case<double>(c, m, 200 + c.n_k * 3 + c.d);
}

std::string case_name(const ::testing::TestParamInfo<SoftmaxVsExact::ParamType>& info) {
  const Case& c = std::get<0>(info.param);
  std::string mask = mask_name(std::get<1>(info.param));
  std::replace(mask.begin(), mask.end(), '+', '_');
  return "nq" + std::to_string(c.n_q) + "_nk" + std::to_string(c.n_k) + "_d" +
         std::to_string(c.d) + "_dv" + std::to_string(c.dv) + "_" + mask;
}

// Sizes from the tiles: kLong spans two key tiles of the forward (512) and several of every
// other tile, and is a multiple of none; kShort fits inside one.
constexpr int64_t kLong = 2 * softmax_detail::kForwardBlockK - 24;  // 1000
constexpr int64_t kShort = softmax_detail::kForwardBlockQ - 28;     // 100
#ifdef LINATTN_SANITIZED
// Under ASan/UBSan (whose job is memory and undefined-behaviour errors, ~10x slower) the
// kLong cases give way to one that still crosses every tile edge (a query tile and a key tile
// of the forward, plus two); the Release run covers them all.
#define LINATTN_LARGE_CASES \
  Case{softmax_detail::kForwardBlockQ + 2, softmax_detail::kForwardBlockK + 88, 64, 40}
#else
#define LINATTN_LARGE_CASES                                                                  \
  Case{kLong, kLong, 16, 16}, Case{kLong, kLong, 64, 64}, Case{kLong, kLong, 96, 96},        \
      Case{1, kLong, 64, 64}, Case{300, kLong, 96, 40}, Case{kLong, kShort, 16, 64}
#endif

INSTANTIATE_TEST_SUITE_P(
    Sizes, SoftmaxVsExact,
    ::testing::Combine(::testing::Values(Case{1, 1, 16, 16}, Case{7, 7, 16, 16}, Case{7, 7, 96, 96},
                                         Case{kShort, kShort, 64, 64}, Case{kShort, kShort, 96, 96},
                                         // n_q != n_k, value_dim != head_dim
                                         Case{7, kShort, 16, 24}, Case{kShort, 7, 64, 32},
                                         LINATTN_LARGE_CASES),
                       ::testing::Values(Mask::None, Mask::Causal, Mask::KeyLengths,
                                         Mask::CausalKeyLengths)),
    case_name);

// The reference against the same exact values: a check of the checker.
TEST(SoftmaxReference, MatchesIndependentExactComputation) {
  for (Mask m : {Mask::None, Mask::Causal, Mask::KeyLengths, Mask::CausalKeyLengths}) {
    const auto q = random_tensor<double>({3, 2, 9, 5}, 1), k = random_tensor<double>({3, 2, 13, 5}, 2),
               v = random_tensor<double>({3, 2, 13, 4}, 3), dout = random_tensor<double>({3, 2, 9, 4}, 4);
    const auto opts = options_for(m, 3, 13, 5);
    const auto exact = testing::softmax_exact_with_bounds<double>(q, k, v, dout, opts);
    const auto f = reference::softmax_attention(q, k, v, opts);
    const auto g = reference::softmax_attention_backward(q, k, v, dout, opts);
    for (int64_t i = 0; i < f.out.size(); ++i) EXPECT_NEAR(f.out[i], exact.out[i], 1e-13);
    for (int64_t i = 0; i < g.dq.size(); ++i) EXPECT_NEAR(g.dq[i], exact.dq[i], 1e-13);
    for (int64_t i = 0; i < g.dk.size(); ++i) EXPECT_NEAR(g.dk[i], exact.dk[i], 1e-13);
    for (int64_t i = 0; i < g.dv.size(); ++i) EXPECT_NEAR(g.dv[i], exact.dv[i], 1e-13);
  }
}

// Central differences of the float64 fast forward: L = Σ out ∘ G.
// Step h = 1e-5 balances truncation h²/6·|L'''| against cancellation u·|L|/h; with O(1)
// inputs both are ~1e-11, so 1e-7·(1 + |g|) leaves four orders of headroom.
TEST(SoftmaxGradient, MatchesCentralDifferences) {
  for (Mask m : {Mask::None, Mask::Causal, Mask::KeyLengths, Mask::CausalKeyLengths}) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{5, 5}, {3, 6}, {6, 4}}) {
      SCOPED_TRACE(::testing::Message() << mask_name(m) << " n_q=" << nq << " n_k=" << nk);
      const int64_t B = 3, H = 2, d = 4, dv = 3;
      auto q = random_tensor<double>({B, H, nq, d}, 11);
      auto k = random_tensor<double>({B, H, nk, d}, 12);
      auto v = random_tensor<double>({B, H, nk, dv}, 13);
      const auto G = random_tensor<double>({B, H, nq, dv}, 14);
      AttentionOptions opts = options_for(m, B, nk, 15);
      opts.scale = 0.7;
      auto loss = [&] {
        const auto out = softmax_attention<double>(q, k, v, opts).out;
        double L = 0;
        for (int64_t i = 0; i < out.size(); ++i) L += out[i] * G[i];
        return L;
      };
      const auto g = softmax_attention_backward<double>(q, k, v, G, opts);
      const double h = 1e-5;
      for (auto [x, dx, name] : {std::tuple{&q, &g.dq, "dq"}, {&k, &g.dk, "dk"}, {&v, &g.dv, "dv"}}) {
        for (int64_t i = 0; i < x->size(); ++i) {
          const double x0 = (*x)[i];
          (*x)[i] = x0 + h;
          const double lp = loss();
          (*x)[i] = x0 - h;
          const double lm = loss();
          (*x)[i] = x0;
          const double fd = (lp - lm) / (2 * h);
          EXPECT_NEAR((*dx)[i], fd, 1e-7 * (1 + std::abs(fd))) << name << "[" << i << "]";
        }
      }
    }
  }
}

// Without a saved forward, the backward recomputes it and gives the same gradients.
TEST(SoftmaxBackward, RecomputingOverloadMatchesSavedOverload) {
  const auto q = random_tensor<float>({2, 3, 130, 32}, 1), k = random_tensor<float>({2, 3, 257, 32}, 2),
             v = random_tensor<float>({2, 3, 257, 16}, 3), dout = random_tensor<float>({2, 3, 130, 16}, 4);
  AttentionOptions opts;
  opts.causal = true;
  const auto f = softmax_attention<float>(q, k, v, opts);
  const auto a = softmax_attention_backward<float>(q, k, v, dout, f.out, f.lse, opts);
  const auto b = softmax_attention_backward<float>(q, k, v, dout, opts);
  for (int64_t i = 0; i < a.dq.size(); ++i) ASSERT_EQ(a.dq[i], b.dq[i]);
  for (int64_t i = 0; i < a.dk.size(); ++i) ASSERT_EQ(a.dk[i], b.dk[i]);
  for (int64_t i = 0; i < a.dv.size(); ++i) ASSERT_EQ(a.dv[i], b.dv[i]);
}

// The float32 forward and backward (forward_f32.cc, backward_f32.cc) on every SIMD target this
// CPU runs (AVX-512, AVX2, SSE4, ...): the same bounds, at sizes that end inside a register
// block, a key panel, a key block and a query block (forward: kRows 48, kKeys 256, kPanel 64;
// backward: 128 × 128 blocks), d and d_v both multiples of 16 (K, V read in place) and not
// (copied, padded), and every mask; 3 threads against batch·heads 6, so keys are not split, and
// 8 threads below, where they are.
TEST(SoftmaxFloat32, MatchesTheBoundOnEverySimdTarget) {
  const int64_t B = 3, H = 2;
  uint64_t seed = 900;
  testing::for_each_simd_target([&](int64_t) {
    for (const Case c : {Case{53, 301, 24, 24}, Case{97, 259, 64, 96}, Case{5, 70, 8, 16}, Case{140, 270, 32, 40}})
      for (Mask m : {Mask::None, Mask::Causal, Mask::KeyLengths, Mask::CausalKeyLengths}) {
        SCOPED_TRACE(::testing::Message() << "mask=" << mask_name(m) << " n_q=" << c.n_q << " n_k=" << c.n_k
                                          << " d=" << c.d << " dv=" << c.dv);
        const auto q = cast<float>(random_tensor<double>({B, H, c.n_q, c.d}, seed++));
        const auto k = cast<float>(random_tensor<double>({B, H, c.n_k, c.d}, seed++));
        const auto v = cast<float>(random_tensor<double>({B, H, c.n_k, c.dv}, seed++));
        const auto dout = cast<double>(cast<float>(random_tensor<double>({B, H, c.n_q, c.dv}, seed++)));
        const AttentionOptions opts = options_for(m, B, c.n_k, seed);
        const auto exact =
            testing::softmax_exact_with_bounds<float>(cast<double>(q), cast<double>(k), cast<double>(v), dout, opts);
        for (int threads : {3, 8}) {
          SCOPED_TRACE(::testing::Message() << "threads=" << threads);
          ScopedThreads scope(threads);
          const auto f = softmax_attention<float>(q, k, v, opts);
          expect_within(f.out, exact.out, exact.out_bound, "out");
          for (int64_t i = 0; i < f.lse.size(); ++i) {
            if (std::isinf(exact.lse[i])) {
              ASSERT_EQ(f.lse[i], -std::numeric_limits<float>::infinity()) << i;
            } else {
              ASSERT_NEAR(f.lse[i], exact.lse[i], exact.lse_bound[i]) << "lse[" << i << "]";
            }
          }
          const auto g = softmax_attention_backward<float>(q, k, v, cast<float>(dout), f.out, f.lse, opts);
          expect_within(g.dq, exact.dq, exact.dq_bound, "dq");
          expect_within(g.dk, exact.dk, exact.dk_bound, "dk");
          expect_within(g.dv, exact.dv, exact.dv_bound, "dv");
        }
      }
  });
}

// The scale is folded into q before the product; a negative scale must still pick each row's
// largest score, and where scale·q could overflow (|q| near 8e37 with |scale| = 8: past float32's
// largest value) the forward and backward apply a power of two of the scale after the product
// instead. Both within the bounds, float32, forward and backward.
TEST(SoftmaxForward, NegativeAndLargeScalesMatchTheBound) {
  struct ScaleCase {
    double q_factor, k_factor, dout_factor, scale;
    bool split() const { return q_factor > 1; }
  };
  uint64_t seed = 950;
  // |q| up to about 8e37 with |scale| = 8: scale·q passes float32's 3.4e38, so the split is needed;
  // k near 1e-38 keeps the scores of order 10, and a small dout keeps dK = scale·Σ dS·q finite.
  // There dQ = scale·Σ dS·k falls among the subnormal numbers, whose absolute rounding the
  // bounds do not model, so dQ is compared only with the normal inputs.
  for (const ScaleCase sc :
       {ScaleCase{1, 1, 1, -0.3}, ScaleCase{2e37, 1e-38, 1e-3, 8}, ScaleCase{2e37, 1e-38, 1e-3, -8}}) {
    SCOPED_TRACE(::testing::Message() << "|q| ~ " << sc.q_factor << " scale=" << sc.scale);
    auto qd = random_tensor<double>({2, 2, 70, 16}, seed++), kd = random_tensor<double>({2, 2, 90, 16}, seed++);
    for (int64_t i = 0; i < qd.size(); ++i) qd[i] *= sc.q_factor;
    for (int64_t i = 0; i < kd.size(); ++i) kd[i] *= sc.k_factor;
    const auto q = cast<float>(qd), k = cast<float>(kd), v = cast<float>(random_tensor<double>({2, 2, 90, 16}, seed++));
    double q_max = 0;
    for (int64_t i = 0; i < q.size(); ++i) q_max = std::max(q_max, std::abs(double(q[i])));
    if (sc.split()) {
      ASSERT_GT(q_max * std::abs(sc.scale), double(std::numeric_limits<float>::max()));
    }
    for (Mask m : {Mask::None, Mask::Causal}) {
      AttentionOptions opts = options_for(m, 2, 90, seed);
      opts.scale = sc.scale;
      auto dd = random_tensor<double>({2, 2, 70, 16}, seed);
      for (int64_t i = 0; i < dd.size(); ++i) dd[i] *= sc.dout_factor;
      const auto dout = cast<float>(dd);
      const auto exact = testing::softmax_exact_with_bounds<float>(cast<double>(q), cast<double>(k), cast<double>(v),
                                                                   cast<double>(dout), opts);
      const auto f = softmax_attention<float>(q, k, v, opts);
      expect_within(f.out, exact.out, exact.out_bound, "out");
      for (int64_t i = 0; i < f.lse.size(); ++i) ASSERT_NEAR(f.lse[i], exact.lse[i], exact.lse_bound[i]) << i;
      const auto g = softmax_attention_backward<float>(q, k, v, dout, f.out, f.lse, opts);
      if (!sc.split()) expect_within(g.dq, exact.dq, exact.dq_bound, "dq");
      expect_within(g.dk, exact.dk, exact.dk_bound, "dk");
      expect_within(g.dv, exact.dv, exact.dv_bound, "dv");
    }
  }
}

// Each query row is computed by one task in a fixed order, so the forward is bitwise the same
// for any thread count.
TEST(SoftmaxForward, BitwiseIdenticalAcrossThreadCounts) {
  // batch·heads 1–3 against 1–16 threads, so that the backward splits keys over workers in some
  // runs and not in others: out and lse, and the backward's dK and dV (each key block summed by
  // one task in query order), are the same bit for bit; dQ sums per-split partials and is held
  // to the bounds elsewhere (SoftmaxFloat32.MatchesTheBoundOnEverySimdTarget at 8 threads).
  for (const int64_t heads : {1, 2, 3})
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "heads=" << heads << " causal=" << causal);
      const auto q = random_tensor<float>({1, heads, 700, 64}, 1), k = random_tensor<float>({1, heads, 900, 64}, 2),
                 v = random_tensor<float>({1, heads, 900, 64}, 3), dout = random_tensor<float>({1, heads, 700, 64}, 4);
      AttentionOptions opts;
      opts.causal = causal;
      Tensor<float> ref_out, ref_dk, ref_dv;
      for (int threads : {1, 2, 3, 5, 8, 16}) {
        ScopedThreads scope(threads);
        const auto f = softmax_attention<float>(q, k, v, opts);
        const auto g = softmax_attention_backward<float>(q, k, v, dout, f.out, f.lse, opts);
        if (threads == 1) {
          ref_out = cast<float>(f.out);
          ref_dk = cast<float>(g.dk);
          ref_dv = cast<float>(g.dv);
          continue;
        }
        for (int64_t i = 0; i < f.out.size(); ++i) ASSERT_EQ(f.out[i], ref_out[i]) << "threads=" << threads;
        for (int64_t i = 0; i < g.dk.size(); ++i) ASSERT_EQ(g.dk[i], ref_dk[i]) << "threads=" << threads;
        for (int64_t i = 0; i < g.dv.size(); ++i) ASSERT_EQ(g.dv[i], ref_dv[i]) << "threads=" << threads;
      }
    }
}

// A kernel called from inside a parallel_for task (on any worker) runs serially there and
// gives the same result: no deadlock on the pool, no shared scratch between tasks.
TEST(SoftmaxForward, CallableFromInsideParallelFor) {
  ScopedThreads scope(2);
  const auto q = random_tensor<float>({1, 2, 200, 16}, 1), k = random_tensor<float>({1, 2, 300, 16}, 2),
             v = random_tensor<float>({1, 2, 300, 16}, 3);
  const auto want = softmax_attention<float>(q, k, v).out;
  std::vector<Tensor<float>> got(6);
  parallel_for(6, [&](int64_t t) { got[t] = softmax_attention<float>(q, k, v).out; });
  for (const auto& out : got)
    for (int64_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], want[i]);
}

// Padded keys may hold anything, NaN included: they never reach the output or the gradients.
// d = d_v = 8: the float32 kernels copy k and v into padded layouts; d = d_v = 16: they read
// them in place (forward_f32.cc, backward_f32.cc). Either way nothing past key_lengths is read.
TEST(SoftmaxMask, PaddedKeysAreIgnoredEvenIfNaN) {
  for (const int64_t d : {8, 16}) {
    SCOPED_TRACE(::testing::Message() << "d=d_v=" << d);
    auto q = random_tensor<float>({2, 2, 20, d}, 1), k = random_tensor<float>({2, 2, 30, d}, 2),
         v = random_tensor<float>({2, 2, 30, d}, 3), dout = random_tensor<float>({2, 2, 20, d}, 4);
    AttentionOptions opts;
    opts.key_lengths = std::vector<int64_t>{17, 30};
    const auto clean = softmax_attention<float>(q, k, v, opts);
    const auto clean_g = softmax_attention_backward<float>(q, k, v, dout, opts);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t j = 17; j < 30; ++j)
        for (int64_t c = 0; c < d; ++c) {
          k.view().row(h, j)[c] = std::numeric_limits<float>::quiet_NaN();
          v.view().row(h, j)[c] = std::numeric_limits<float>::infinity();
        }
    const auto dirty = softmax_attention<float>(q, k, v, opts);
    const auto dirty_g = softmax_attention_backward<float>(q, k, v, dout, opts);
    for (int64_t i = 0; i < clean.out.size(); ++i) ASSERT_EQ(clean.out[i], dirty.out[i]);
    for (int64_t i = 0; i < clean_g.dq.size(); ++i) ASSERT_EQ(clean_g.dq[i], dirty_g.dq[i]);
    // Padded keys get zero gradient.
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t j = 17; j < 30; ++j)
        for (int64_t c = 0; c < d; ++c) {
          ASSERT_EQ(dirty_g.dk.view().row(h, j)[c], 0.f);
          ASSERT_EQ(dirty_g.dv.view().row(h, j)[c], 0.f);
        }
  }
}

// Rows that see no key: zeros and lse = -inf, never NaN (causal with n_q > n_k, and length 0).
TEST(SoftmaxMask, RowsWithoutKeysGetZeros) {
  const auto q = random_tensor<float>({1, 1, 10, 4}, 1), k = random_tensor<float>({1, 1, 4, 4}, 2),
             v = random_tensor<float>({1, 1, 4, 4}, 3), dout = random_tensor<float>({1, 1, 10, 4}, 4);
  AttentionOptions opts;
  opts.causal = true;  // offset n_k - n_q = -6: rows 0..5 see nothing
  const auto f = softmax_attention<float>(q, k, v, opts);
  const auto g = softmax_attention_backward<float>(q, k, v, dout, opts);
  for (int64_t i = 0; i < 10; ++i) {
    const bool empty = i < 6;
    EXPECT_EQ(std::isinf(f.lse[i]) && f.lse[i] < 0, empty) << i;
    for (int64_t c = 0; c < 4; ++c) {
      EXPECT_FALSE(std::isnan(f.out.view().row(0, i)[c]));
      if (empty) {
        EXPECT_EQ(f.out.view().row(0, i)[c], 0.f);
        EXPECT_EQ(g.dq.view().row(0, i)[c], 0.f);
      }
    }
  }
}

// Extra memory is O(n·d): the float32 forward packs a copy of k (forward_f32.cc) beside fixed
// per-worker tiles; the backward copies its operands once (backward_f32.cc).
TEST(SoftmaxMemory, WorkspaceGrowsLinearly) {
  auto workspace = [](int64_t n, bool backward) {
    const auto q = random_tensor<float>({1, 2, n, 64}, 1), k = random_tensor<float>({1, 2, n, 64}, 2),
               v = random_tensor<float>({1, 2, n, 64}, 3);
    const auto f = softmax_attention<float>(q, k, v);
    reset_workspace_peak();
    const int64_t before = workspace_stats().current_bytes;
    if (backward) {
      (void)softmax_attention_backward<float>(q, k, v, q, f.out, f.lse);
    } else {
      (void)softmax_attention<float>(q, k, v);
    }
    return workspace_stats().peak_bytes - before;
  };
  for (int threads : {1, 2}) {
    ScopedThreads scope(threads);
    // Forward: the packed keys (n·d floats per batch·head, n a multiple of 64 here) and tiles
    // independent of n.
    EXPECT_EQ(workspace(4096, false) - workspace(512, false), int64_t{(4096 - 512) * 64 * 2 * 4});
    // Backward: affine in n, per batch·head and position the copies of backward_f32.cc (q, qᵀ,
    // doutᵀ: 2d + d_v; kᵀ, vᵀ: d + d_v), the dQ sums (d) and δ (1) floats, beside per-worker tiles
    // under 1 MiB: 12 MiB at n = 4096, a fifth of one n×n score matrix (64 MiB).
    const int64_t a = workspace(1024, true), b = workspace(2048, true), c = workspace(4096, true);
    EXPECT_EQ(c - b, 2 * (b - a));
    EXPECT_LE(c, int64_t{2} * 4096 * (3 * 64 + 2 * 64 + 64 + 1) * 4 + (1 << 20));
  }
}

// ---- bad input -----------------------------------------------------------------------------

TEST(SoftmaxErrors, ShapesAreChecked) {
  const auto q = random_tensor<float>({2, 3, 5, 8}, 1), k = random_tensor<float>({2, 3, 6, 8}, 2),
             v = random_tensor<float>({2, 3, 6, 4}, 3);
  EXPECT_THAT(error_of([&] { softmax_attention<float>(q, random_tensor<float>({2, 3, 6, 7}, 4), v); }),
              HasSubstr("k has shape [2, 3, 6, 7]; expected [2, 3, n_k, 8]"));
  EXPECT_THAT(error_of([&] { softmax_attention<float>(q, random_tensor<float>({2, 2, 6, 8}, 4), v); }),
              HasSubstr("k has shape [2, 2, 6, 8]"));
  EXPECT_THAT(error_of([&] { softmax_attention<float>(q, k, random_tensor<float>({2, 3, 5, 4}, 4)); }),
              HasSubstr("v has shape [2, 3, 5, 4]; expected [2, 3, 6, value_dim]"));
  EXPECT_THAT(error_of([&] { softmax_attention<float>(random_tensor<float>({3, 5, 8}, 4), k, v); }),
              HasSubstr("q must have rank 4"));
  EXPECT_THAT(error_of([&] { softmax_attention<float>(random_tensor<float>({2, 3, 5, 0}, 4), random_tensor<float>({2, 3, 6, 0}, 4), v); }),
              HasSubstr("head_dim (last dimension of q) must be >= 1"));
  EXPECT_THAT(error_of([&] { softmax_attention_backward<float>(q, k, v, random_tensor<float>({2, 3, 5, 8}, 4)); }),
              HasSubstr("dout has shape [2, 3, 5, 8]; expected [2, 3, 5, 4]"));
  const auto f = softmax_attention<float>(q, k, v);
  EXPECT_THAT(error_of([&] { softmax_attention_backward<float>(q, k, v, f.out, f.out, random_tensor<float>({2, 3, 6}, 1)); }),
              HasSubstr("lse has shape [2, 3, 6]; expected [2, 3, 5]"));
}

TEST(SoftmaxErrors, OptionsAreChecked) {
  const auto q = random_tensor<float>({2, 1, 5, 8}, 1), k = random_tensor<float>({2, 1, 6, 8}, 2),
             v = random_tensor<float>({2, 1, 6, 8}, 3);
  AttentionOptions o;
  o.key_lengths = std::vector<int64_t>{6};
  EXPECT_THAT(error_of([&] { softmax_attention<float>(q, k, v, o); }),
              HasSubstr("key_lengths has 1 entries; expected one per batch item (2)"));
  o.key_lengths = std::vector<int64_t>{6, 7};
  EXPECT_THAT(error_of([&] { softmax_attention<float>(q, k, v, o); }),
              HasSubstr("key_lengths[1] = 7; expected 0 <= key_lengths[b] <= n_k = 6"));
  o.key_lengths = std::vector<int64_t>{-1, 2};
  EXPECT_THAT(error_of([&] { softmax_attention<float>(q, k, v, o); }), HasSubstr("key_lengths[0] = -1"));
  AttentionOptions s;
  s.scale = std::numeric_limits<double>::infinity();
  EXPECT_THAT(error_of([&] { softmax_attention<float>(q, k, v, s); }), HasSubstr("scale must be finite"));
  s.scale = std::nan("");
  EXPECT_THAT(error_of([&] { softmax_attention_backward<float>(q, k, v, q, s); }), HasSubstr("scale must be finite"));
}

// Non-finite inputs are rejected wherever they would reach the result: all of q and dout,
// and k, v at unpadded positions (padded ones are ignored, see PaddedKeysAreIgnoredEvenIfNaN).
TEST(SoftmaxErrors, NonFiniteInputsAreRejected) {
  for (const char* which : {"q", "k", "v", "dout"}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      auto q = random_tensor<float>({1, 2, 5, 4}, 1), k = random_tensor<float>({1, 2, 5, 4}, 2),
           v = random_tensor<float>({1, 2, 5, 4}, 3), dout = random_tensor<float>({1, 2, 5, 4}, 4);
      Tensor<float>* t = which[0] == 'q' ? &q : which[0] == 'k' ? &k : which[0] == 'v' ? &v : &dout;
      (*t)[27] = bad;  // [0, 1, 1, 3]
      const std::string err = error_of([&] { softmax_attention_backward<float>(q, k, v, dout); });
      EXPECT_THAT(err, HasSubstr(std::string(which) + " has a non-finite value"));
      EXPECT_THAT(err, HasSubstr("at [0, 1, 1, 3]"));
      if (which[0] != 'd') {
        EXPECT_THAT(error_of([&] { softmax_attention<float>(q, k, v); }), HasSubstr("non-finite"));
      }
    }
  }
}

// Finite inputs whose scores overflow float32 are an error, not inf/NaN output.
TEST(SoftmaxErrors, ScoreOverflowIsAnError) {
  auto q = random_tensor<float>({1, 1, 3, 4}, 1, 1e20), k = random_tensor<float>({1, 1, 3, 4}, 2, 1e20),
       v = random_tensor<float>({1, 1, 3, 4}, 3);
  EXPECT_THAT(error_of([&] { softmax_attention<float>(q, k, v); }), HasSubstr("overflows"));
}

// Empty batch, heads or sequences are valid and give empty or zero results.
TEST(SoftmaxErrors, ZeroSizesAreValid) {
  {
    const auto q = random_tensor<float>({0, 2, 5, 4}, 1), k = random_tensor<float>({0, 2, 5, 4}, 2);
    const auto f = softmax_attention<float>(q, k, k);
    EXPECT_EQ(f.out.shape(), (Shape{0, 2, 5, 4}));
    const auto g = softmax_attention_backward<float>(q, k, k, q);
    EXPECT_EQ(g.dq.size(), 0);
  }
  {
    const auto q = random_tensor<float>({1, 2, 0, 4}, 1), k = random_tensor<float>({1, 2, 5, 4}, 2);
    EXPECT_EQ(softmax_attention<float>(q, k, k).out.shape(), (Shape{1, 2, 0, 4}));
    const auto g = softmax_attention_backward<float>(q, k, k, q);
    for (int64_t i = 0; i < g.dk.size(); ++i) EXPECT_EQ(g.dk[i], 0.f);
  }
  {
    const auto q = random_tensor<float>({1, 2, 3, 4}, 1), k = random_tensor<float>({1, 2, 0, 4}, 2);
    const auto f = softmax_attention<float>(q, k, k);
    for (int64_t i = 0; i < f.out.size(); ++i) EXPECT_EQ(f.out[i], 0.f);
    for (int64_t i = 0; i < f.lse.size(); ++i) EXPECT_EQ(f.lse[i], -std::numeric_limits<float>::infinity());
  }
}

}  // namespace
}  // namespace linattn
