// Nyström attention: fast path against the tracked float64 reference (bounds derived from the
// arithmetic, tracked_matrix.h), gradients against central differences, the exact limit, masks,
// batch independence and errors.
#include <gtest/gtest.h>

#include "linattn/core/tracked_matrix.h"
#include "linattn/nystrom.h"
#include "linattn/nystrom/pinv.h"
#include "linattn/softmax.h"
#include "linattn/nystrom/reference.h"
#include "reference_bounds.h"
#include "test_util.h"

namespace linattn::testing {
namespace {

struct Case {
  int64_t B, H, n, d, dv, landmarks, K;  // K = 0: no convolution
  bool masked;
};

NystromOptions options(const Case& c, const std::string& pinv) {
  NystromOptions o;
  o.num_landmarks = c.landmarks;
  o.pinv = pinv;
  if (c.masked) {  // the last item loses a third of its positions (at least one position stays)
    std::vector<int64_t> lengths(static_cast<size_t>(c.B), c.n);
    lengths.back() = std::max<int64_t>(1, c.n - c.n / 3 - 1);
    o.key_lengths = lengths;
  }
  return o;
}

template <class T>
void check_case(const Case& c, const std::string& pinv, int threads) {
  SCOPED_TRACE(::testing::Message() << "n=" << c.n << " m=" << c.landmarks << " d=" << c.d
                                    << " K=" << c.K << " masked=" << c.masked << " pinv=" << pinv
                                    << " threads=" << threads << " T=" << sizeof(T));
  ScopedThreads scoped(threads);
  const int64_t clusters = std::max<int64_t>(1, std::min(c.landmarks, c.n / 2));
  const auto q = clustered({c.B, c.H, c.n, c.d}, clusters, 2.0, 1),
             k = clustered({c.B, c.H, c.n, c.d}, clusters, 2.0, 2);
  const auto v = random_tensor<double>({c.B, c.H, c.n, c.dv}, 3),
             dout = random_tensor<double>({c.B, c.H, c.n, c.dv}, 4),
             w = random_tensor<double>({c.H, std::max<int64_t>(c.K, 1)}, 5, 0.3);
  const NystromOptions o = options(c, pinv);
  std::optional<TensorView<const double>> wd;
  std::optional<TensorView<const T>> wt;
  const auto w_t = cast<T>(w);
  if (c.K > 0) wd = w.view(), wt = w_t.view();
  const double u = unit_roundoff<T>(), u64 = unit_roundoff<double>();
  const auto qt = cast<T>(q), kt = cast<T>(k), vt = cast<T>(v), dt = cast<T>(dout);
  // The reference runs on the inputs as the fast path sees them (rounded to T).
  const auto q64 = cast<double>(qt), k64 = cast<double>(kt), v64 = cast<double>(vt),
             d64 = cast<double>(dt);
  const auto ref = reference::nystrom_attention(q64, k64, v64, o, wd, u);
  const auto ref64 = reference::nystrom_attention(q64, k64, v64, o, wd, u64);
  expect_matches(nystrom_attention<T>(qt, kt, vt, o, wt), ref, ref64, "out");
  // The bounds are worst-case and first-order. Through the six Newton–Schulz-type steps of
  // pinv="iterative" they grow by ~5 per step (|P||T| products cannot see the iteration's
  // self-correction), which leaves them informative in float64 but not in float32: there the
  // float32 iterative path is held to its (valid, loose) bound here, and each of its steps to
  // that step's tight bound in NystromPinv.EveryFloat32IterationStepIsWithinItsBound.
  if (std::is_same_v<T, double>)
    expect_informative(ref, 1e-3, "out");
  else if (pinv == std::string("exact"))
    expect_informative(ref, 0.1, "out");
  const auto g = nystrom_attention_backward<T>(qt, kt, vt, dt, o, wt);
  const auto gr = reference::nystrom_attention_backward(q64, k64, v64, d64, o, wd, u);
  const auto gr64 = reference::nystrom_attention_backward(q64, k64, v64, d64, o, wd, u64);
  expect_matches(g.dq, gr[0], gr64[0], "dq");
  expect_matches(g.dk, gr[1], gr64[1], "dk");
  expect_matches(g.dv, gr[2], gr64[2], "dv");
  if (c.K > 0) expect_matches(g.param("conv_weight"), gr[3], gr64[3], "d_conv_weight");
}

const Case kCases[] = {
    {2, 2, 37, 8, 5, 5, 0, false},    // segments of 7 or 8 positions, some shared
    {2, 2, 37, 8, 5, 5, 3, true},     // with padding and the convolution
    {1, 3, 300, 16, 12, 16, 5, true}, // crosses the 256-row query block
    {2, 1, 6, 4, 3, 8, 0, true},      // more landmarks than positions
    {1, 2, 1, 4, 3, 4, 0, false},     // one position
};

TEST(NystromVsReference, Float32) {
  for (const Case& c : kCases)
    for (const char* pinv : {"iterative", "exact"})
      for (int threads : {1, 2}) check_case<float>(c, pinv, threads);
}

TEST(NystromVsReference, Float64) {
  for (const Case& c : kCases)
    for (const char* pinv : {"iterative", "exact"}) check_case<double>(c, pinv, 2);
}

// The componentwise bound through all six iterations is not informative in float32 (above),
// but each step's is: every float32 step of the fast iterative pseudo-inverse, from its own
// float32 input V_k, must land within that step's derived rounding bound of the float64 step.
// With every step checked, the float32 iterate differs from the float64 one only by how the
// iteration itself propagates those rounding errors.
TEST(NystromPinv, EveryFloat32IterationStepIsWithinItsBound) {
  for (int64_t m : {5, 16, 40}) {
    SCOPED_TRACE(::testing::Message() << "m=" << m);
    // A landmark kernel as the method makes one: softmax of scores with a dominant diagonal.
    Tensor<float> A({m, m});
    const auto noise = random_tensor<double>({m, m}, 50 + m);
    for (int64_t i = 0; i < m; ++i) {
      double mx = -INFINITY, sum = 0;
      std::vector<double> row(static_cast<size_t>(m));
      for (int64_t j = 0; j < m; ++j) mx = std::max(mx, row[j] = noise[i * m + j] + (i == j ? 4.0 : 0.0));
      for (int64_t j = 0; j < m; ++j) sum += row[j] = std::exp(row[j] - mx);
      for (int64_t j = 0; j < m; ++j) A[i * m + j] = static_cast<float>(row[j] / sum);
    }
    const int64_t iters = 6;
    Tensor<float> Z({m, m}), iterates({iters + 1, m, m}), scratch({nystrom::pinv_scratch_size(m)});
    nystrom::pinv_forward<float>(nystrom::PinvMethod::Iterative, A.data(), m, iters, Z.data(),
                                 iterates.data(), scratch.data());
    const auto A64 = cast<double>(A);
    const reference::Tracked At = reference::input(A64.data(), m, m, m);
    const reference::Arith a32{unit_roundoff<float>()}, a64{unit_roundoff<double>()};
    auto check = [&](const reference::Tracked& want, const reference::Tracked& want64, int64_t k) {
      double max_ratio = 0, vmax = 0, bmax = 0;
      for (int64_t i = 0; i < m * m; ++i) {
        const double got = iterates[k * m * m + i], bound = want.err[i] + want64.err[i];
        ASSERT_LE(std::abs(got - want.val[i]), bound) << "V_" << k << " element " << i;
        max_ratio = std::max(max_ratio, std::abs(got - want.val[i]) / bound);
        vmax = std::max(vmax, std::abs(want.val[i]));
        bmax = std::max(bmax, bound);
      }
      EXPECT_LE(bmax, 1e-3 * vmax) << "V_" << k << ": the step bound is too loose to test anything";
      if (std::getenv("LINATTN_TEST_VERBOSE")) std::printf("  V_%lld: max error/bound %.3g\n", (long long)k, max_ratio);
    };
    check(reference::pinv_initial_iterate(a32, At), reference::pinv_initial_iterate(a64, At), 0);
    for (int64_t k = 0; k < iters; ++k) {
      Tensor<double> vk({m, m});
      for (int64_t i = 0; i < m * m; ++i) vk[i] = iterates[k * m * m + i];
      const reference::Tracked V = reference::input(vk.data(), m, m, m);
      check(reference::pinv_iteration(a32, At, V), reference::pinv_iteration(a64, At, V), k + 1);
    }
    for (int64_t i = 0; i < m * m; ++i) ASSERT_EQ(Z[i], iterates[iters * m * m + i]);
  }
}

// Central differences of the float64 fast forward for q, k, v and the convolution weight,
// through both pseudo-inverses, with segments that share positions and a padded item.
TEST(NystromGradient, MatchesCentralDifferences) {
  for (const char* pinv : {"iterative", "exact"}) {
    SCOPED_TRACE(pinv);
    const int64_t B = 2, H = 2, n = 11, d = 4, dv = 3, K = 3;
    auto q = clustered({B, H, n, d}, 4, 1.5, 11), k = clustered({B, H, n, d}, 4, 1.5, 12);
    auto v = random_tensor<double>({B, H, n, dv}, 13), w = random_tensor<double>({H, K}, 14, 0.3);
    const auto G = random_tensor<double>({B, H, n, dv}, 15);
    NystromOptions o;
    o.num_landmarks = 4;
    o.pinv = pinv;
    o.key_lengths = std::vector<int64_t>{n, 7};
    auto loss = [&] { return dot_loss(nystrom_attention<double>(q, k, v, o, w.view()), G); };
    const auto g = nystrom_attention_backward<double>(q, k, v, G, o, w.view());
    expect_gradient(q, g.dq, loss, "dq");
    expect_gradient(k, g.dk, loss, "dk");
    expect_gradient(v, g.dv, loss, "dv");
    expect_gradient(w, g.param("conv_weight"), loss, "d_conv_weight");
  }
}

// With a landmark per position and the exact pseudo-inverse, Nyström is softmax attention:
// softmax(QKᵀs)·A⁺·A·V with A = softmax(KKᵀ…) invertible. Tolerance: the tracked bound of the
// float64 Nyström path (u = 2⁻⁵³) plus the float64 softmax path's rounding, 2·(n+16)·u·max|v|.
TEST(NystromExact, EqualsSoftmaxAttentionWithALandmarkPerPosition) {
  const int64_t B = 2, H = 2, n = 24, d = 8, dv = 5;
  const auto q = clustered({B, H, n, d}, 6, 1.0, 21), k = clustered({B, H, n, d}, 6, 1.0, 22);
  const auto v = random_tensor<double>({B, H, n, dv}, 23);
  for (bool masked : {false, true}) {
    NystromOptions o;
    o.num_landmarks = 100;
    o.pinv = "exact";
    AttentionOptions so;
    if (masked) o.key_lengths = so.key_lengths = std::vector<int64_t>{n, 17};
    const auto ny = nystrom_attention<double>(q, k, v, o);
    const auto sm = softmax_attention<double>(q, k, v, so).out;
    const auto bound = reference::nystrom_attention(q, k, v, o, std::nullopt, unit_roundoff<double>());
    double vmax = 0;
    for (int64_t i = 0; i < v.size(); ++i) vmax = std::max(vmax, std::abs(v[i]));
    Tensor<double> tol(bound.bound.shape());
    for (int64_t i = 0; i < tol.size(); ++i)
      tol[i] = 2 * bound.bound[i] + 2 * gamma<double>(n + 16) * vmax;
    expect_within(ny, sm, tol, masked ? "masked" : "unmasked");
  }
}

// pinv="iterative" scales V₀ by each matrix's own norms: a batch item's result must not change
// when another item, with much larger inputs, joins the batch.
TEST(NystromBatch, ItemsAreIndependent) {
  const int64_t H = 2, n = 40, d = 8, dv = 4;
  auto q = cast<float>(clustered({2, H, n, d}, 8, 2.0, 31)), k = cast<float>(clustered({2, H, n, d}, 8, 2.0, 32));
  const auto v = cast<float>(random_tensor<double>({2, H, n, dv}, 33));
  for (int64_t i = q.size() / 2; i < q.size(); ++i) q[i] *= 4, k[i] *= 4;
  NystromOptions o;
  o.num_landmarks = 8;
  const auto both = nystrom_attention<float>(q, k, v, o);
  const int64_t half = H * n * d, vhalf = H * n * dv;
  const TensorView<const float> q0{q.data(), {1, H, n, d}}, k0{k.data(), {1, H, n, d}},
      v0{v.data(), {1, H, n, dv}};
  const auto alone = nystrom_attention<float>(q0, k0, v0, o);
  for (int64_t i = 0; i < vhalf; ++i) ASSERT_EQ(both[i], alone[i]) << i;
  (void)half;
}

// Padded keys and values (positions >= key_lengths[b]) are never read.
TEST(NystromMask, PaddedPositionsAreIgnored) {
  const int64_t B = 2, H = 1, n = 30, d = 8, dv = 4, len = 19;
  auto q = clustered({B, H, n, d}, 5, 2.0, 41), k = clustered({B, H, n, d}, 5, 2.0, 42);
  auto v = random_tensor<double>({B, H, n, dv}, 43);
  const auto w = random_tensor<double>({H, 5}, 44);
  NystromOptions o;
  o.num_landmarks = 6;
  o.key_lengths = std::vector<int64_t>{n, len};
  const auto out = nystrom_attention<double>(q, k, v, o, w.view());
  for (int64_t j = len; j < n; ++j) {
    for (int64_t c = 0; c < d; ++c) k.view().row(1, j)[c] = NAN;
    for (int64_t c = 0; c < dv; ++c) v.view().row(1, j)[c] = NAN;
  }
  const auto out2 = nystrom_attention<double>(q, k, v, o, w.view());
  for (int64_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], out2[i]) << i;
  // A sequence with no valid position gets 0.
  o.key_lengths = std::vector<int64_t>{n, 0};
  const auto out3 = nystrom_attention<double>(q, k, v, o, w.view());
  for (int64_t i = n * dv; i < out3.size(); ++i) ASSERT_EQ(out3[i], 0.0);
}

TEST(NystromErrors, OptionsAndShapesAreChecked) {
  const auto q = random_tensor<float>({1, 2, 10, 4}, 1), k = random_tensor<float>({1, 2, 10, 4}, 2),
             v = random_tensor<float>({1, 2, 10, 3}, 3), k9 = random_tensor<float>({1, 2, 9, 4}, 4),
             v9 = random_tensor<float>({1, 2, 9, 3}, 5), w4 = random_tensor<float>({2, 4}, 6),
             w1 = random_tensor<float>({1, 3}, 7);
  auto err = [&](NystromOptions o, std::optional<TensorView<const float>> w = std::nullopt) {
    return error_of([&] { nystrom_attention<float>(q, k, v, o, w); });
  };
  NystromOptions o;
  o.causal = true;
  EXPECT_NE(err(o).find("future positions"), std::string::npos) << err(o);
  o = {};
  o.num_landmarks = 0;
  EXPECT_NE(err(o).find("num_landmarks must be >= 1, got 0"), std::string::npos) << err(o);
  o = {};
  o.pinv_iterations = -1;
  EXPECT_NE(err(o).find("pinv_iterations must be >= 0"), std::string::npos) << err(o);
  o = {};
  o.pinv = "svd";
  EXPECT_NE(err(o).find("pinv must be \"iterative\" or \"exact\", got \"svd\""), std::string::npos) << err(o);
  o = {};
  o.key_lengths = std::vector<int64_t>{11};
  EXPECT_NE(err(o).find("key_lengths[0] = 11"), std::string::npos) << err(o);
  EXPECT_NE(err({}, w4.view()).find("conv_weight needs an odd K"), std::string::npos);
  EXPECT_NE(err({}, w1.view()).find("conv_weight has shape [1, 3]; expected [heads = 2, K]"), std::string::npos);
  EXPECT_NE(error_of([&] { nystrom_attention<float>(q, k9, v9); }).find("same sequence length"),
            std::string::npos);
  const auto bad_dout = random_tensor<float>({1, 2, 10, 4}, 8);
  EXPECT_NE(error_of([&] { nystrom_attention_backward<float>(q, k, v, bad_dout); })
                .find("dout has shape [1, 2, 10, 4]; expected [1, 2, 10, 3]"),
            std::string::npos);
}

}  // namespace
}  // namespace linattn::testing
