// Exact attention's bfloat16-product forward (softmax/forward_bf16.cc) on each engine this CPU
// has (AMX tiles, AVX512-BF16) against the float64 reference on the same inputs, widened
// exactly. An engine the CPU lacks is skipped (saying why); on a CPU with neither, the registry
// test checks that bfloat16 calls take the widened float32 forward.
//
// The bound, per output element, with u = 2⁻⁸ (bfloat16), u₃₂ = 2⁻²⁴, n_k keys, |v|max over the
// keys of that (batch, head):
//   |out − ref| ≤ u·|ref|                    the output's rounding
//              + (u + 2·e_p + 3·n_k·u₃₂)·|v|max  P rounded to bfloat16 (relative u per weight,
//                                            at most u·|v|max in a weighted mean), the scores'
//                                            and exp's float32 error e_p per weight, the
//                                            float32 sums of l and of P·V
// (|v|max over the keys the batch item has: keys past key_lengths may hold anything).
// with e_p = scale·d·u₃₂·max Σ_f |q_f·k_f| + 4·u₃₂. lse: |lse − ref| ≤ e_p + n_k·u₃₂ + 2·u₃₂·|ref|.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "linattn/linattn.h"
#include "linattn/core/amx.h"
#include "linattn/core/avx512_bf16.h"
#include "linattn/core/attention_args.h"
#include "linattn/softmax/forward_internal.h"
#include "linattn/softmax/reference.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::narrowed;
using testing::random_tensor;
using testing::ScopedThreads;

constexpr double kU = 0x1p-8, kU32 = 0x1p-24;

Tensor<double> to_f64(const Tensor<bfloat16>& x) { return testing::cast<double>(widen(x.view())); }

struct Case {
  int64_t batch, heads, n_q, n_k, d, dv;
  bool causal;
  std::vector<int64_t> key_lengths;  // empty: none
  double sigma = 1.0;
};

using softmax_detail::Bf16Engine;

// A case's inputs (dout too), options and checked dimensions.
struct CaseInputs {
  Tensor<bfloat16> q, k, v, dout;
  AttentionOptions o;
  AttentionDims dims;
  double scale;
  explicit CaseInputs(const Case& c)
      : q(narrowed<bfloat16>(random_tensor<double>({c.batch, c.heads, c.n_q, c.d}, 1, c.sigma))),
        k(narrowed<bfloat16>(random_tensor<double>({c.batch, c.heads, c.n_k, c.d}, 2, c.sigma))),
        v(narrowed<bfloat16>(random_tensor<double>({c.batch, c.heads, c.n_k, c.dv}, 3))),
        dout(narrowed<bfloat16>(random_tensor<double>({c.batch, c.heads, c.n_q, c.dv}, 4))) {
    o.causal = c.causal;
    if (!c.key_lengths.empty()) o.key_lengths = c.key_lengths;
    dims = check_attention_args<bfloat16>("test", q, k, v, o);
    scale = resolve_scale("test", o, c.d);
  }
};

std::string describe(const Case& c, int threads) {
  return (::testing::Message() << "B=" << c.batch << " H=" << c.heads << " n_q=" << c.n_q << " n_k=" << c.n_k
                               << " d=" << c.d << " dv=" << c.dv << (c.causal ? " causal" : "")
                               << (c.key_lengths.empty() ? "" : " key_lengths") << " threads=" << threads)
      .GetString();
}

// The forward's error terms for batch·head bh (the bound above): e_p, the float32 error of one
// score, and spread = (u + 2·e_p + 3·n_k·u₃₂)·|v|max over the keys the batch item has.
struct ForwardTerms {
  double e_p, spread;
};
ForwardTerms forward_terms(const Case& c, const Tensor<double>& q64, const Tensor<double>& k64,
                           const Tensor<double>& v64, int64_t bh, double scale) {
  double vmax = 0, qk = 0;
  const int64_t keys = c.key_lengths.empty() ? c.n_k : c.key_lengths[bh / c.heads];
  for (int64_t j = 0; j < keys; ++j)
    for (int64_t f = 0; f < c.dv; ++f) vmax = std::max(vmax, std::abs(v64[(bh * c.n_k + j) * c.dv + f]));
  for (int64_t i = 0; i < c.n_q; ++i)
    for (int64_t j = 0; j < c.n_k; ++j) {
      double s = 0;
      for (int64_t f = 0; f < c.d; ++f) s += std::abs(q64[(bh * c.n_q + i) * c.d + f] * k64[(bh * c.n_k + j) * c.d + f]);
      qk = std::max(qk, s);
    }
  const double e_p = scale * c.d * kU32 * qk + 4 * kU32;
  return {e_p, (kU + 2 * e_p + 3 * c.n_k * kU32) * vmax};
}

void expect_within_bound(Bf16Engine engine, const Case& c, int threads) {
  SCOPED_TRACE(std::string(softmax_detail::engine_name(engine)) + " " + describe(c, threads));
  ScopedThreads scope(threads);
  const CaseInputs in(c);
  const double scale = in.scale;
  ASSERT_TRUE(softmax_detail::bf16_tiles_usable(in.dims, scale, engine));
  const softmax_detail::Bf16TilesResult got =
      softmax_detail::forward_bf16_tiles(in.q, in.k, in.v, in.dims, in.o, scale, engine);
  const Tensor<double> q64 = to_f64(in.q), k64 = to_f64(in.k), v64 = to_f64(in.v);
  const SoftmaxAttentionResult<double> ref = reference::softmax_attention(q64, k64, v64, in.o);

  for (int64_t bh = 0; bh < c.batch * c.heads; ++bh) {
    const auto [e_p, spread] = forward_terms(c, q64, k64, v64, bh, scale);
    for (int64_t i = 0; i < c.n_q; ++i) {
      const double lse_ref = ref.lse[bh * c.n_q + i], lse_got = got.lse[bh * c.n_q + i];
      if (std::isinf(lse_ref)) {
        ASSERT_EQ(lse_got, lse_ref) << "row " << i << " sees no key";
      } else {
        ASSERT_LE(std::abs(lse_got - lse_ref), e_p + c.n_k * kU32 + 2 * kU32 * std::abs(lse_ref)) << "lse row " << i;
      }
      for (int64_t f = 0; f < c.dv; ++f) {
        const double r = ref.out[(bh * c.n_q + i) * c.dv + f], g = to_float(got.out[(bh * c.n_q + i) * c.dv + f]);
        ASSERT_LE(std::abs(g - r), kU * std::abs(r) + spread) << "out [" << bh << ", " << i << ", " << f << "]";
      }
    }
  }
}

// Each engine's tests run where the CPU has it (a parameterised suite: one test per engine).
class SoftmaxBf16Products : public ::testing::TestWithParam<Bf16Engine> {
 protected:
  void SetUp() override {
    if (GetParam() == Bf16Engine::amx && !amx::bf16_usable())
      GTEST_SKIP() << "no AMX-BF16 tiles here: " << amx::unavailable_reason();
    if (GetParam() == Bf16Engine::avx512_bf16 && !avx512_bf16::usable())
      GTEST_SKIP() << "no AVX512-BF16 here: " << avx512_bf16::unavailable_reason();
  }
};
INSTANTIATE_TEST_SUITE_P(Engines, SoftmaxBf16Products, ::testing::Values(Bf16Engine::amx, Bf16Engine::avx512_bf16),
                         [](const auto& info) { return info.param == Bf16Engine::amx ? "amx" : "avx512_bf16"; });

// Odd sizes (tails of the 16-row tiles, 32-deep products, 256-key blocks and 16-column values),
// every mask, rows that see no key, and thread counts below and above batch·heads.
TEST_P(SoftmaxBf16Products, MatchTheFloat64ReferenceWithinTheBound) {
  const std::vector<Case> cases = {
      {1, 1, 1, 1, 1, 1, false, {}},
      {2, 3, 33, 47, 17, 5, false, {}},
      {2, 3, 33, 47, 17, 5, true, {}},
      {1, 2, 300, 300, 64, 64, true, {}},
      {2, 1, 257, 513, 80, 130, false, {}},
      {2, 2, 70, 40, 33, 16, true, {}},  // n_q > n_k: the first 30 rows see no key
      {2, 3, 45, 600, 128, 48, false, {0, 555}},
      {2, 3, 600, 600, 64, 31, true, {600, 301}},
      {1, 2, 64, 700, 64, 64, false, {}, 3.0},  // sharp rows: scores up to ~100
  };
  for (const Case& c : cases)
    for (int threads : {1, 3, 4, 8, 9, 16}) expect_within_bound(GetParam(), c, threads);
}

// Keys past key_lengths are never read: NaN and inf there give bitwise the result of zeros
// there (the float32 forward's contract, include/linattn/attention.h).
TEST_P(SoftmaxBf16Products, PaddedKeysAreNeverRead) {
  const int64_t B = 2, H = 2, n = 50, d = 20;
  const Tensor<bfloat16> q = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 7));
  Tensor<bfloat16> k = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 8)), v = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 9));
  Tensor<bfloat16> k_bad = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 8)),
                   v_bad = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 9));
  AttentionOptions o;
  o.key_lengths = std::vector<int64_t>{17, 30};
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t j = (*o.key_lengths)[bh / H]; j < n; ++j)
      for (int64_t f = 0; f < d; ++f) {
        k_bad[(bh * n + j) * d + f] = to_bfloat16(std::numeric_limits<float>::quiet_NaN());
        v_bad[(bh * n + j) * d + f] = to_bfloat16(std::numeric_limits<float>::infinity());
        k[(bh * n + j) * d + f] = v[(bh * n + j) * d + f] = bfloat16{0};
      }
  for (bool causal : {false, true}) {
    o.causal = causal;
    const AttentionDims dims = check_attention_args<bfloat16>("test", q, k_bad, v_bad, o);
    const double scale = resolve_scale("test", o, d);
    const auto bad = softmax_detail::forward_bf16_tiles(q, k_bad, v_bad, dims, o, scale, GetParam());
    const auto zero = softmax_detail::forward_bf16_tiles(q, k, v, dims, o, scale, GetParam());
    for (int64_t i = 0; i < bad.out.size(); ++i) ASSERT_EQ(bad.out[i].bits, zero.out[i].bits) << i;
    testing::expect_identical(bad.lse, zero.lse, "lse");
  }
}

// The registry's bfloat16 forward takes the best engine when it can (bitwise its result: AMX,
// else AVX512-BF16) and the widened float32 forward otherwise: neither engine, scale ≤ 0, or
// values past 2^64.
TEST(SoftmaxBf16Registry, TakesTheBestEngineWhenItCan) {
  const std::optional<Bf16Engine> best = softmax_detail::bf16_engine();
  ASSERT_EQ(best.has_value(), amx::bf16_usable() || avx512_bf16::usable());
  if (best) {
    ASSERT_EQ(*best == Bf16Engine::amx, amx::bf16_usable());
  }
  const MethodInfo& m = method("softmax");
  const int64_t B = 1, H = 2, n = 90, d = 24;
  Tensor<bfloat16> q = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 4)),
                   k = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 5)),
                   v = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 6));
  auto check = [&](const MethodArgs<bfloat16>& a, bool tiles, const std::string& what) {
    SCOPED_TRACE(what);
    const MethodOutput<bfloat16> got = m.bf16.forward(a);
    if (tiles) {
      AttentionOptions o;
      o.causal = std::get<bool>(a.options.at("causal"));
      const AttentionDims dims = check_attention_args("test", a.q, a.k, a.v, o);
      const auto want = softmax_detail::forward_bf16_tiles(a.q, a.k, a.v, dims, o, resolve_scale("test", o, d), *best);
      ASSERT_EQ(got.out.shape(), want.out.shape());
      for (int64_t i = 0; i < want.out.size(); ++i) ASSERT_EQ(got.out[i].bits, want.out[i].bits) << i;
      testing::expect_identical(got.saved.at(0).second, want.lse, "lse");
    } else {
      MethodArgs<float> w;
      const Tensor<float> q32 = widen(a.q), k32 = widen(a.k), v32 = widen(a.v);
      w.q = q32, w.k = k32, w.v = v32, w.options = a.options;
      const MethodOutput<float> want = m.f32.forward(w);
      for (int64_t i = 0; i < want.out.size(); ++i) ASSERT_EQ(got.out[i].bits, to_bfloat16(want.out[i]).bits) << i;
      testing::expect_identical(got.saved.at(0).second, want.saved.at(0).second, "lse");
    }
  };
  MethodArgs<bfloat16> a;
  a.q = q, a.k = k, a.v = v;
  for (bool causal : {false, true}) {
    a.options = {{"causal", causal}};
    check(a, best.has_value(), causal ? "causal" : "not causal");
  }
  a.options = {{"causal", false}, {"scale", -0.25}};
  check(a, false, "scale < 0");
  a.options = {{"causal", false}};
  v[7] = to_bfloat16(0x1p70f);
  check(a, false, "|v| > 2^64");
}

// Scores past float32's range are the same error as in the float32 forward: scaled past it
// here (q·kᵀ = 2^111 within the kernel's range, ·2^20), and through the registry where q·kᵀ
// itself is past it (the widened forward takes that call).
TEST_P(SoftmaxBf16Products, OverflowingScoresAreAnError) {
  Tensor<bfloat16> q({1, 1, 3, 2}), k({1, 1, 3, 2}), v({1, 1, 3, 2});
  for (int64_t i = 0; i < 6; ++i) q[i] = to_bfloat16(0x1p55f), k[i] = to_bfloat16(0x1p55f), v[i] = to_bfloat16(1.0f);
  AttentionOptions o;
  o.scale = 0x1p20;
  const AttentionDims dims = check_attention_args<bfloat16>("test", q, k, v, o);
  ASSERT_TRUE(softmax_detail::bf16_tiles_usable(dims, *o.scale, GetParam()));
  std::string e = testing::error_of([&] { softmax_detail::forward_bf16_tiles(q, k, v, dims, o, *o.scale, GetParam()); });
  EXPECT_NE(e.find("softmax_attention: q·kᵀ·scale overflows at row"), std::string::npos) << e;
  for (int64_t i = 0; i < 6; ++i) q[i] = to_bfloat16(1e30f), k[i] = to_bfloat16(1e30f);
  MethodArgs<bfloat16> a;
  a.q = q, a.k = k, a.v = v;
  e = testing::error_of([&] { method("softmax").bf16.forward(a); });
  EXPECT_NE(e.find("softmax_attention: "), std::string::npos) << e;
  EXPECT_NE(e.find("overflow"), std::string::npos) << e;
}

// The backward with bfloat16 products (backward_bf16.cc) against the float64 reference. With
// P, dP, δ and dS the float64 quantities, ρ the float32 relative error of P (the score's e_p
// and the saved lse's, as above) and Δδ_i the error of δ_i from the bfloat16 forward's out
// (u·|out| + spread per element, as above, and the float32 dot product):
//   E_ij = (u + ρ + 3·u₃₂)·|dS_ij| + P_ij·(e_dP_ij + Δδ_i),  e_dP_ij = (d_v + 1)·u₃₂·Σ_c |dout_ic·v_jc|
// bounds the error of one bfloat16 dS_ij (its rounding, P's, dP's and δ's), and then
//   |dK_jf − ref| ≤ u·|ref| + (1 + 2u)·scale·Σ_i (E_ij + (n_q + 1)·u₃₂·|dS_ij|)·|q_if|
//   |dQ_if − ref| ≤ u·|ref| + (1 + 2u)·scale·Σ_j (E_ij + (n_k + 17)·u₃₂·|dS_ij|)·|k_jf|   (≤ 16 key splits)
//   |dV_jc − ref| ≤ u·|ref| + (1 + 2u)·Σ_i (u + ρ + (n_q + 1)·u₃₂)·P_ij·|dout_ic|
// (1 + 2u covers the second-order terms). Subnormals are flushed to zero (inputs read as 0,
// results of each rounded step set to 0, P and dS rounded to 0 below 2⁻¹²⁶): E_ij gets
// P_ij·2·(d_v + 1)·2⁻¹²⁶ for dP's and δ's sums, and each gradient n·2⁻¹²⁶·(max|other| + 2) for
// its n terms (a flushed operand times the other, two flushed steps).
void expect_backward_within_bound(const Case& c, int threads) {
  SCOPED_TRACE("backward " + describe(c, threads));
  ScopedThreads scope(threads);
  const CaseInputs in(c);
  const Tensor<bfloat16>&q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
  const AttentionOptions& o = in.o;
  const AttentionDims& dims = in.dims;
  const double scale = in.scale;
  double dout_max = 0;
  for (int64_t i = 0; i < dout.size(); ++i) dout_max = std::max<double>(dout_max, std::abs(to_float(dout[i])));
  ASSERT_TRUE(softmax_detail::bf16_backward_usable(dims, scale, dout_max));
  const std::optional<Bf16Engine> engine = softmax_detail::bf16_engine();
  ASSERT_TRUE(engine.has_value());
  const softmax_detail::Bf16TilesResult fwd = softmax_detail::forward_bf16_tiles(q, k, v, dims, o, scale, *engine);
  const Tensor<float> out32 = widen(fwd.out.view());
  const AttentionGrads<float> got32 =
      softmax_detail::backward_bf16_products(q, k, v, dout, out32, fwd.lse, dims, o, scale);

  // Through the registry, with the saved tensors and without (the forward run again): the
  // same gradients, rounded once.
  MethodArgs<bfloat16> a;
  a.q = q, a.k = k, a.v = v;
  a.options = {{"causal", c.causal}};
  if (!c.key_lengths.empty()) a.options["key_lengths"] = c.key_lengths;
  const MethodInfo& m = method("softmax");
  const AttentionGrads<bfloat16> recomputed = m.bf16.backward(a, dout, {});
  const AttentionGrads<bfloat16> from_saved = m.bf16.backward(a, dout, {{"out", out32.view()}, {"lse", fwd.lse.view()}});
  for (const auto* g : {&recomputed, &from_saved}) {
    for (int64_t i = 0; i < got32.dq.size(); ++i) ASSERT_EQ(g->dq[i].bits, to_bfloat16(got32.dq[i]).bits) << "dq " << i;
    for (int64_t i = 0; i < got32.dk.size(); ++i) ASSERT_EQ(g->dk[i].bits, to_bfloat16(got32.dk[i]).bits) << "dk " << i;
    for (int64_t i = 0; i < got32.dv.size(); ++i) ASSERT_EQ(g->dv[i].bits, to_bfloat16(got32.dv[i]).bits) << "dv " << i;
  }

  const Tensor<double> q64 = to_f64(q), k64 = to_f64(k), v64 = to_f64(v), do64 = to_f64(dout);
  const AttentionGrads<double> ref = reference::softmax_attention_backward(q64, k64, v64, do64, o);
  const SoftmaxAttentionResult<double> ref_fwd = reference::softmax_attention(q64, k64, v64, o);
  const int64_t n_q = c.n_q, n_k = c.n_k, d = c.d, dv = c.dv;
  const double sub = 0x1p-126;
  const KeyMask mask(dims, o);
  for (int64_t bh = 0; bh < c.batch * c.heads; ++bh) {
    const int64_t b = bh / c.heads;
    auto Q = [&](int64_t i, int64_t f) { return q64[(bh * n_q + i) * d + f]; };
    auto K = [&](int64_t j, int64_t f) { return k64[(bh * n_k + j) * d + f]; };
    auto V = [&](int64_t j, int64_t f) { return v64[(bh * n_k + j) * dv + f]; };
    auto DO = [&](int64_t i, int64_t f) { return do64[(bh * n_q + i) * dv + f]; };
    double lse_max = 0, q_abs = 0, k_abs = 0, do_abs = 0;
    for (int64_t j = 0; j < n_k; ++j)
      for (int64_t f = 0; f < d; ++f) k_abs = std::max(k_abs, std::abs(K(j, f)));
    for (int64_t i = 0; i < n_q; ++i) {
      for (int64_t f = 0; f < d; ++f) q_abs = std::max(q_abs, std::abs(Q(i, f)));
      for (int64_t f = 0; f < dv; ++f) do_abs = std::max(do_abs, std::abs(DO(i, f)));
    }
    for (int64_t i = 0; i < n_q; ++i)
      if (std::isfinite(ref_fwd.lse[bh * n_q + i])) lse_max = std::max(lse_max, std::abs(ref_fwd.lse[bh * n_q + i]));
    const auto [e_p, spread] = forward_terms(c, q64, k64, v64, bh, scale);
    const double rho = 2 * e_p + n_k * kU32 + 2 * kU32 * lse_max + 4 * kU32;
    // P, |dS| and E (n_q × n_k), then the three bounds.
    std::vector<double> P(n_q * n_k, 0.0), dS(n_q * n_k, 0.0), E(n_q * n_k, 0.0);
    for (int64_t i = 0; i < n_q; ++i) {
      const double lse = ref_fwd.lse[bh * n_q + i];
      const int64_t visible = std::isfinite(lse) ? mask.visible(b, i) : 0;
      double delta = 0, d_delta = 0;
      for (int64_t f = 0; f < dv; ++f) {
        const double out = ref_fwd.out[(bh * n_q + i) * dv + f];
        delta += DO(i, f) * out;
        d_delta += std::abs(DO(i, f)) * (kU * std::abs(out) + spread) + (dv + 1) * kU32 * std::abs(DO(i, f) * out);
      }
      for (int64_t j = 0; j < visible; ++j) {
        double s = 0, dp = 0, dp_mag = 0;
        for (int64_t f = 0; f < d; ++f) s += Q(i, f) * K(j, f);
        for (int64_t f = 0; f < dv; ++f) dp += DO(i, f) * V(j, f), dp_mag += std::abs(DO(i, f) * V(j, f));
        const double p = std::exp(scale * s - lse);
        P[i * n_k + j] = p;
        dS[i * n_k + j] = std::abs(p * (dp - delta));
        E[i * n_k + j] = (kU + rho + 3 * kU32) * dS[i * n_k + j] + p * ((dv + 1) * kU32 * dp_mag + d_delta) +
                         p * 2 * (dv + 1) * sub;
      }
    }
    const double second = 1 + 2 * kU;
    for (int64_t j = 0; j < n_k; ++j) {
      for (int64_t f = 0; f < d; ++f) {
        double bound = 0;
        for (int64_t i = 0; i < n_q; ++i)
          bound += (E[i * n_k + j] + (n_q + 1) * kU32 * dS[i * n_k + j]) * std::abs(Q(i, f));
        const double r = ref.dk[(bh * n_k + j) * d + f];
        const double g = to_float(from_saved.dk[(bh * n_k + j) * d + f]);
        ASSERT_LE(std::abs(g - r), kU * std::abs(r) + second * scale * bound + scale * n_q * sub * (q_abs + 2)) << "dk [" << bh << ", " << j << ", " << f << "]";
      }
      for (int64_t f = 0; f < dv; ++f) {
        double bound = 0;
        for (int64_t i = 0; i < n_q; ++i) bound += (kU + rho + (n_q + 1) * kU32) * P[i * n_k + j] * std::abs(DO(i, f));
        const double r = ref.dv[(bh * n_k + j) * dv + f];
        const double g = to_float(from_saved.dv[(bh * n_k + j) * dv + f]);
        ASSERT_LE(std::abs(g - r), kU * std::abs(r) + second * bound + n_q * sub * (do_abs + 2)) << "dv [" << bh << ", " << j << ", " << f << "]";
      }
    }
    for (int64_t i = 0; i < n_q; ++i)
      for (int64_t f = 0; f < d; ++f) {
        double bound = 0;
        for (int64_t j = 0; j < n_k; ++j)
          bound += (E[i * n_k + j] + (n_k + 17) * kU32 * dS[i * n_k + j]) * std::abs(K(j, f));
        const double r = ref.dq[(bh * n_q + i) * d + f];
        const double g = to_float(from_saved.dq[(bh * n_q + i) * d + f]);
        ASSERT_LE(std::abs(g - r), kU * std::abs(r) + second * scale * bound + scale * n_k * sub * (k_abs + 2)) << "dq [" << bh << ", " << i << ", " << f << "]";
      }
  }
}

// Odd sizes (tails of the 128-key and 128-query blocks, 16-column blocks, odd d and d_v), every
// mask, rows that see no key, and thread counts below and above batch·heads (key splits).
TEST(SoftmaxBf16Backward, MatchesTheFloat64ReferenceWithinTheBound) {
  if (!avx512_bf16::usable()) GTEST_SKIP() << "no AVX512-BF16 here: " << avx512_bf16::unavailable_reason();
  const std::vector<Case> cases = {
      {1, 1, 1, 1, 1, 1, false, {}},
      {2, 3, 33, 47, 17, 5, false, {}},
      {2, 3, 33, 47, 17, 5, true, {}},
      {1, 2, 300, 300, 64, 64, true, {}},
      {1, 1, 257, 300, 80, 130, false, {}},
      {2, 2, 70, 40, 33, 16, true, {}},  // n_q > n_k: the first 30 rows see no key
      {2, 1, 45, 300, 128, 48, false, {0, 255}},
      {2, 1, 300, 300, 64, 31, true, {300, 141}},
      {1, 1, 64, 300, 64, 64, false, {}, 3.0},  // sharp rows
  };
  for (const Case& c : cases)
    for (int threads : {1, 3, 4, 8, 9, 16}) expect_backward_within_bound(c, threads);
}

// Thread counts above and below batch·heads (1–3) give the same results: the forward and the
// backward's dK, dV bitwise (each row is one task's, in a fixed order); dQ sums per-split
// partials whose association depends on the thread count, so it is held to the bound above.
TEST(SoftmaxBf16Backward, ThreadCountsGiveTheSameResults) {
  if (!avx512_bf16::usable()) GTEST_SKIP() << "no AVX512-BF16 here: " << avx512_bf16::unavailable_reason();
  const MethodInfo& m = method("softmax");
  for (const auto& [batch, heads] : {std::pair<int64_t, int64_t>{1, 1}, {1, 2}, {3, 1}}) {
    const Case c{batch, heads, 300, 300, 40, 24, true, {}};
    const CaseInputs in(c);
    MethodArgs<bfloat16> a;
    a.q = in.q, a.k = in.k, a.v = in.v;
    a.options = {{"causal", true}};
    std::optional<MethodOutput<bfloat16>> first_out;
    std::optional<AttentionGrads<bfloat16>> first;
    for (int threads : {1, 3, 8, 16}) {
      SCOPED_TRACE(describe(c, threads));
      ScopedThreads scope(threads);
      MethodOutput<bfloat16> out = m.bf16.forward(a);
      AttentionGrads<bfloat16> g = m.bf16.backward(a, in.dout, {});
      if (!first) {
        first_out = std::move(out), first = std::move(g);
        continue;
      }
      for (int64_t i = 0; i < out.out.size(); ++i) ASSERT_EQ(out.out[i].bits, first_out->out[i].bits) << "out " << i;
      testing::expect_identical(out.saved.at(0).second, first_out->saved.at(0).second, "lse");
      for (int64_t i = 0; i < g.dk.size(); ++i) ASSERT_EQ(g.dk[i].bits, first->dk[i].bits) << "dk " << i;
      for (int64_t i = 0; i < g.dv.size(); ++i) ASSERT_EQ(g.dv[i].bits, first->dv[i].bits) << "dv " << i;
    }
  }
}

// The backward leaves to the widened float32 one what it does not take (bitwise that result):
// scale ≤ 0, |dout| or |v| past 2^48, and |q|·|k|·d past 2^120.
TEST(SoftmaxBf16Backward, RegistryWidensOutsideItsRange) {
  const MethodInfo& m = method("softmax");
  const int64_t B = 1, H = 2, n = 40, d = 8;
  Tensor<bfloat16> q = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 4)),
                   k = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 5)),
                   v = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 6));
  Tensor<bfloat16> dout = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 7));
  auto expect_widened = [&](const MethodArgs<bfloat16>& a, const std::string& what) {
    SCOPED_TRACE(what);
    MethodArgs<float> w;
    auto wide = [](const Tensor<bfloat16>& t) { return widen(TensorView<const bfloat16>(t)); };
    const Tensor<float> q32 = wide(q), k32 = wide(k), v32 = wide(v), do32 = wide(dout);
    w.q = q32, w.k = k32, w.v = v32, w.options = a.options;
    const AttentionGrads<float> want = m.f32.backward(w, do32, {});
    const AttentionGrads<bfloat16> got = m.bf16.backward(a, dout, {});
    for (int64_t i = 0; i < want.dq.size(); ++i) ASSERT_EQ(got.dq[i].bits, to_bfloat16(want.dq[i]).bits) << i;
    for (int64_t i = 0; i < want.dk.size(); ++i) ASSERT_EQ(got.dk[i].bits, to_bfloat16(want.dk[i]).bits) << i;
    for (int64_t i = 0; i < want.dv.size(); ++i) ASSERT_EQ(got.dv[i].bits, to_bfloat16(want.dv[i]).bits) << i;
  };
  MethodArgs<bfloat16> a;
  a.q = q, a.k = k, a.v = v;
  a.options = {{"causal", false}, {"scale", -0.25}};
  expect_widened(a, "scale < 0");
  a.options = {{"causal", true}};
  dout[3] = to_bfloat16(0x1p60f);
  expect_widened(a, "|dout| > 2^48");
  dout[3] = bfloat16{0};
  v[5] = to_bfloat16(0x1p50f);
  expect_widened(a, "|v| > 2^48");
  v[5] = bfloat16{0};
  // q·kᵀ itself past float32 while q·kᵀ·scale is not: summed unscaled, it would overflow.
  q[0] = to_bfloat16(0x1p70f), k[0] = to_bfloat16(0x1p55f);  // q·k ≤ 2^125: finite, but past the bound
  a.options = {{"causal", false}, {"scale", 0x1p-100}};
  expect_widened(a, "|q|·|k|·d > 2^120");
}

// Keys past key_lengths are never read by the backward either: NaN and inf there give bitwise
// the gradients of zeros there, and zero dk, dv for those keys.
TEST(SoftmaxBf16Backward, PaddedKeysAreNeverRead) {
  if (!avx512_bf16::usable()) GTEST_SKIP() << "no AVX512-BF16 here: " << avx512_bf16::unavailable_reason();
  const int64_t B = 2, H = 2, n = 150, d = 20;
  const Tensor<bfloat16> q = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 7)),
                         dout = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 10));
  Tensor<bfloat16> k = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 8)),
                   v = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 9)),
                   k_bad = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 8)),
                   v_bad = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 9));
  const std::vector<int64_t> lengths = {17, 130};
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t j = lengths[bh / H]; j < n; ++j)
      for (int64_t f = 0; f < d; ++f) {
        k_bad[(bh * n + j) * d + f] = to_bfloat16(std::numeric_limits<float>::quiet_NaN());
        v_bad[(bh * n + j) * d + f] = to_bfloat16(std::numeric_limits<float>::infinity());
        k[(bh * n + j) * d + f] = v[(bh * n + j) * d + f] = bfloat16{0};
      }
  const MethodInfo& m = method("softmax");
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    MethodArgs<bfloat16> bad, zero;
    bad.q = zero.q = q, bad.k = k_bad, bad.v = v_bad, zero.k = k, zero.v = v;
    bad.options = zero.options = {{"causal", causal}, {"key_lengths", lengths}};
    const AttentionGrads<bfloat16> gb = m.bf16.backward(bad, dout, {}), gz = m.bf16.backward(zero, dout, {});
    for (int64_t i = 0; i < gz.dq.size(); ++i) ASSERT_EQ(gb.dq[i].bits, gz.dq[i].bits) << "dq " << i;
    for (int64_t i = 0; i < gz.dk.size(); ++i) ASSERT_EQ(gb.dk[i].bits, gz.dk[i].bits) << "dk " << i;
    for (int64_t i = 0; i < gz.dv.size(); ++i) ASSERT_EQ(gb.dv[i].bits, gz.dv[i].bits) << "dv " << i;
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t j = lengths[bh / H]; j < n; ++j)
        for (int64_t f = 0; f < d; ++f) {
          ASSERT_EQ(gb.dk[(bh * n + j) * d + f].bits, 0) << "dk past key_lengths";
          ASSERT_EQ(gb.dv[(bh * n + j) * d + f].bits, 0) << "dv past key_lengths";
        }
  }
}

// Bad input is the float32 backward's error: a non-finite dout, a saved lse of the wrong shape.
TEST(SoftmaxBf16Backward, BadInputIsAnError) {
  const int64_t B = 1, H = 1, n = 5, d = 4;
  const Tensor<bfloat16> q = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 4));
  Tensor<bfloat16> dout = narrowed<bfloat16>(random_tensor<double>({B, H, n, d}, 7));
  dout[6] = to_bfloat16(std::numeric_limits<float>::quiet_NaN());
  MethodArgs<bfloat16> a;
  a.q = q, a.k = q, a.v = q;
  a.options = {{"causal", false}};
  const MethodInfo& m = method("softmax");
  std::string e = testing::error_of([&] { m.bf16.backward(a, dout, {}); });
  EXPECT_NE(e.find("softmax_attention_backward: dout has a non-finite value"), std::string::npos) << e;
  dout[6] = bfloat16{0};
  const Tensor<float> out({B, H, n, d}), lse({B, H, n + 1});
  e = testing::error_of([&] { m.bf16.backward(a, dout, {{"out", out.view()}, {"lse", lse.view()}}); });
  EXPECT_NE(e.find("softmax_attention_backward: lse has shape [1, 1, 6]; expected [1, 1, 5]"), std::string::npos) << e;
}

}  // namespace
}  // namespace linattn
