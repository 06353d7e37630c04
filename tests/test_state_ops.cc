// The state-level operations (key_state, apply_state, causal_from_state and their backwards):
// a sequence cut into blocks, its block states added by the documented rule, gives the
// float64 reference's output within the bounds of kernelized_bounds.h (the state sums the same
// terms in another order), at 1, 4 and 9 threads (batch·heads = 6), with padding; every
// backward against central differences in float64; bad input is an error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "kernelized_bounds.h"
#include "linattn/kernelized.h"
#include "linattn/random_features.h"
#include "test_util.h"

namespace linattn {
namespace {

using ::testing::HasSubstr;
using testing::cast;
using testing::error_of;
using testing::random_tensor;
using testing::recurrent_options;
using testing::rows;

const std::vector<std::string> kMaps = {"elu", "relu", "focused", "given", "positive", "hyperbolic", "trig"};

// y[:, :, t0:t0+n'] = x.
template <class T>
void put_rows(Tensor<T>& y, const Tensor<T>& x, int64_t t0) {
  const int64_t BH = x.dim(0) * x.dim(1), nx = x.dim(2), D = x.dim(3), n = y.dim(2);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t t = 0; t < nx; ++t)
      for (int64_t c = 0; c < D; ++c) y[(bh * n + t0 + t) * D + c] = x[(bh * nx + t) * D + c];
}

// The sum of two states (include/linattn/kernelized.h): c = max(c¹, c²), [S | z] =
// [S¹ | z¹]·exp(c¹ − c) + [S² | z²]·exp(c² − c), a term at −inf being 0.
template <class T>
Tensor<T> add_states(const Tensor<T>& a, const Tensor<T>& b) {
  Tensor<T> s(a.shape());
  const int64_t row = a.dim(3);
  for (int64_t at = 0; at < a.size(); at += row) {
    const T ca = a[at + row - 1], cb = b[at + row - 1], c = std::max(ca, cb);
    const T fa = ca == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(ca - c);
    const T fb = cb == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(cb - c);
    for (int64_t i = 0; i + 1 < row; ++i) s[at + i] = a[at + i] * fa + b[at + i] * fb;
    s[at + row - 1] = c;
  }
  return s;
}

// The state of no keys: zeros, shifts −inf (FAVOR) or 0.
template <class T>
Tensor<T> empty_state(const Shape& shape, bool favor) {
  Tensor<T> s(shape);
  if (favor)
    for (int64_t at = shape[3] - 1; at < s.size(); at += shape[3]) s[at] = -std::numeric_limits<T>::infinity();
  return s;
}

// The lengths of a block [t0, t1) of sequences whose keys end at `lengths`.
std::optional<std::vector<int64_t>> block_lengths(const std::optional<std::vector<int64_t>>& lengths, int64_t t0,
                                                  int64_t t1) {
  if (!lengths) return std::nullopt;
  std::vector<int64_t> out;
  for (int64_t len : *lengths) out.push_back(std::clamp<int64_t>(len - t0, 0, t1 - t0));
  return out;
}

struct Inputs {
  Tensor<double> q, k, v, w;
};

Inputs inputs(const std::string& map, int64_t B, int64_t H, int64_t n, int64_t d, int64_t dv, uint64_t seed) {
  Inputs x{random_tensor<double>({B, H, n, d}, seed), random_tensor<double>({B, H, n, d}, seed + 1),
           random_tensor<double>({B, H, n, dv}, seed + 2), cast<double>(random_features<double>(16, d, FeatureKind::Orthogonal, seed + 3))};
  if (map == "given")  // given features are >= 0
    for (Tensor<double>* t : {&x.q, &x.k})
      for (int64_t i = 0; i < t->size(); ++i) (*t)[i] = std::abs((*t)[i]);
  return x;
}

// The whole sequence's outputs from its blocks: non-causal, apply_state of the sum of every
// block's key_state; causal, causal_from_state of each block from the sum of the states before
// it. Returns the output and the final state (causal: the last block's state_after; else the sum).
template <class T>
std::pair<Tensor<T>, Tensor<T>> blockwise(const std::string& map, const Tensor<T>& q, const Tensor<T>& k,
                                          const Tensor<T>& v, const Tensor<T>& w, const std::vector<int64_t>& cuts,
                                          bool causal, const std::optional<std::vector<int64_t>>& lengths) {
  const StateOptions o = recurrent_options(map);
  const bool favor = o.feature_map == "favor";
  const std::optional<TensorView<const T>> proj = favor ? std::optional<TensorView<const T>>(w.view()) : std::nullopt;
  Tensor<T> out({q.dim(0), q.dim(1), q.dim(2), v.dim(3)});
  const int64_t m = map == "hyperbolic" || map == "trig" ? 2 * w.dim(0) : favor ? w.dim(0) : q.dim(3);
  Tensor<T> total = empty_state<T>({q.dim(0), q.dim(1), m, v.dim(3) + 2}, favor);
  for (size_t b = 0; b + 1 < cuts.size(); ++b) {
    const int64_t t0 = cuts[b], t1 = cuts[b + 1];
    const auto kb = rows(k, t0, t1), vb = rows(v, t0, t1), qb = rows(q, t0, t1);
    if (causal) {
      auto r = causal_from_state<T>(qb, kb, vb, total, o, proj, block_lengths(lengths, t0, t1));
      put_rows(out, r.out, t0);
      total = std::move(r.state);
    } else {
      total = add_states(total, key_state<T>(kb, vb, o, proj, block_lengths(lengths, t0, t1)));
    }
  }
  if (!causal)
    for (size_t b = 0; b + 1 < cuts.size(); ++b) {
      const int64_t t0 = cuts[b], t1 = cuts[b + 1];
      put_rows(out, apply_state<T>(rows(q, t0, t1), total, o, proj).out, t0);
    }
  return {std::move(out), std::move(total)};
}

template <class T>
void check_blocks_match_reference(const std::string& map, bool causal) {
  const int64_t B = 2, H = 3, n = 77, d = 8, dv = 5;
  const Inputs x = inputs(map, B, H, n, d, dv, 10);
  const std::optional<std::vector<int64_t>> lengths = std::vector<int64_t>{77, 35};
  testing::KernelizedSpec spec;
  spec.map = map;
  spec.causal = causal;
  spec.key_lengths = lengths;
  const auto q = cast<T>(x.q), k = cast<T>(x.k), v = cast<T>(x.v), w = cast<T>(x.w);
  const auto wd = cast<double>(w);
  const auto exact = testing::kernelized_exact_with_bounds<T>(cast<double>(q), cast<double>(k), cast<double>(v),
                                                              Tensor<double>(v.shape()), &wd, spec);
  // Blocks of 30, 1, 9 (item 1's padding starts inside it, at 35) and 37 rows (item 1: no key);
  // 37 > the engine's causal chunk, so the causal form crosses chunks from a prefix.
  const std::vector<int64_t> cuts = {0, 30, 31, 40, 77};
  std::optional<Tensor<T>> first;
  for (int threads : {1, 4, 9}) {
    testing::ScopedThreads scope(threads);
    auto [out, state] = blockwise<T>(map, q, k, v, w, cuts, causal, lengths);
    const std::string what = map + (causal ? " causal" : "") + " blocks, " + std::to_string(threads) + " threads";
    testing::expect_within(out, exact.out, exact.out_bound, what.c_str());
    if (first) testing::expect_identical(out, *first, what + " against 1 thread");  // per batch·head: no reordering
    else first = std::move(out);
  }
}

TEST(StateOps, BlocksGiveTheWholeSequence) {
  for (const auto& map : kMaps)
    for (bool causal : {false, true}) {
      SCOPED_TRACE(map + (causal ? " causal" : ""));
      check_blocks_match_reference<float>(map, causal);
      check_blocks_match_reference<double>(map, causal);
    }
}

// The causal form's state after all blocks is the key state of the whole sequence (float64:
// the same sums in another order, to a few ulps of their magnitude).
TEST(StateOps, CausalFinalStateIsTheKeyState) {
  for (const auto& map : kMaps) {
    SCOPED_TRACE(map);
    const Inputs x = inputs(map, 2, 3, 50, 6, 4, 20);
    const std::optional<std::vector<int64_t>> lengths = std::vector<int64_t>{50, 33};
    const auto [out, state] = blockwise<double>(map, x.q, x.k, x.v, x.w, {0, 17, 50}, true, lengths);
    const StateOptions o = recurrent_options(map);
    const bool favor = o.feature_map == "favor";
    const auto whole = key_state<double>(x.k, x.v, o, favor ? std::optional<TensorView<const double>>(x.w.view())
                                                            : std::nullopt, lengths);
    double top = 0;
    for (int64_t i = 0; i < whole.size(); ++i)
      if (std::isfinite(whole[i])) top = std::max(top, std::abs(whole[i]));
    for (int64_t i = 0; i < whole.size(); ++i) {
      if (state[i] == whole[i]) continue;  // −inf shifts compare equal, not near
      ASSERT_NEAR(state[i], whole[i], 1e-13 * top) << i;
    }
  }
}

// FAVOR at large norms: logits in the hundreds, far beyond exp's range without the shifts. The
// blocks' states combine to favor_attention's output on the whole sequence.
TEST(StateOps, FavorShiftsKeepLargeNormsFinite) {
  const Inputs x = inputs("positive", 1, 2, 40, 8, 3, 30);
  Tensor<float> q = cast<float>(x.q), k = cast<float>(x.k);
  for (int64_t i = 0; i < k.size(); ++i) k[i] *= 30, q[i] *= 30;
  const auto v = cast<float>(x.v), w = cast<float>(x.w);
  for (bool causal : {false, true}) {
    auto [out, state] = blockwise<float>("positive", q, k, v, w, {0, 13, 40}, causal, std::nullopt);
    FavorOptions fo;
    fo.causal = causal;
    const auto whole = favor_attention<float>(q, k, v, w, fo);
    for (int64_t i = 0; i < out.size(); ++i) {
      ASSERT_TRUE(std::isfinite(out[i])) << i;
      ASSERT_NEAR(out[i], whole[i], 1e-4 * (1 + std::abs(whole[i]))) << (causal ? "causal " : "") << i;
    }
  }
}

// ---- gradients: central differences of float64 forwards -----------------------------------

// Non-causal: L = Σ G∘apply_state(q, key_state(k, v)); the chain apply_state_backward ->
// key_state_backward gives dq, dk, dv. (The shifts depend on k piecewise, and the chain's
// result does not depend on them, so only such compositions are differentiable as functions.)
TEST(StateOps, NonCausalBackwardsMatchFiniteDifferences) {
  for (const auto& map : kMaps) {
    SCOPED_TRACE(map);
    Inputs x = inputs(map, 1, 2, 7, 3, 2, 40);
    Tensor<double> q2 = random_tensor<double>({1, 2, 5, 3}, 41);
    if (map == "given")
      for (int64_t i = 0; i < q2.size(); ++i) q2[i] = std::abs(q2[i]);
    const StateOptions o = recurrent_options(map);
    const bool favor = o.feature_map == "favor";
    const auto proj = favor ? std::optional<TensorView<const double>>(x.w.view()) : std::nullopt;
    const std::optional<std::vector<int64_t>> lengths = std::vector<int64_t>{5};
    const auto G = random_tensor<double>({1, 2, 5, 2}, 42);
    auto loss = [&] {
      return testing::dot_loss(apply_state<double>(q2, key_state<double>(x.k, x.v, o, proj, lengths), o, proj).out, G);
    };
    const auto state = key_state<double>(x.k, x.v, o, proj, lengths);
    const auto r = apply_state<double>(q2, state, o, proj);
    const auto ga = apply_state_backward<double>(q2, state, G, r.out, r.den, o, proj);
    const auto gk = key_state_backward<double>(x.k, x.v, state, ga.dstate, o, proj, lengths);
    for (int64_t r2 = 0; r2 < ga.dstate.dim(2) * 2; ++r2) ASSERT_EQ(ga.dstate[r2 * 4 + 3], 0);  // shifts: no gradient
    testing::expect_gradient(q2, ga.dq, loss, "dq");
    testing::expect_gradient(x.k, gk.dk, loss, "dk");
    testing::expect_gradient(x.v, gk.dv, loss, "dv");
    for (int64_t i = 5 * 3; i < 7 * 3; ++i) ASSERT_EQ(gk.dk[i], 0) << "padded key";
  }
}

// Causal: L = Σ G1∘out + Σ G2∘apply_state(q2, state_after) with out, state_after =
// causal_from_state(q, k, v, prefix), the prefix key_state(k0, v0) or the empty state (what
// the first segment of a split sequence starts from): every input's gradient through the
// chain, dprefix and dstate_after included. 40 rows: more than one of the engine's chunks.
TEST(StateOps, CausalBackwardMatchesFiniteDifferences) {
  for (const auto& map : kMaps)
    for (bool empty_prefix : {false, true}) {
      SCOPED_TRACE(map + (empty_prefix ? " from the empty state" : ""));
      const int64_t n = 40, d = 3, dv = 2;
      Inputs x = inputs(map, 1, 2, n, d, dv, 50);
      Inputs x0 = inputs(map, 1, 2, 6, d, dv, 60);
      Tensor<double> q2 = random_tensor<double>({1, 2, 3, d}, 61);
      if (map == "given")
        for (int64_t i = 0; i < q2.size(); ++i) q2[i] = std::abs(q2[i]);
      const StateOptions o = recurrent_options(map);
      const bool favor = o.feature_map == "favor";
      const auto proj = favor ? std::optional<TensorView<const double>>(x.w.view()) : std::nullopt;
      const std::optional<std::vector<int64_t>> lengths = std::vector<int64_t>{35};
      const auto G1 = random_tensor<double>({1, 2, n, dv}, 62), G2 = random_tensor<double>({1, 2, 3, dv}, 63);
      const int64_t m = map == "hyperbolic" || map == "trig" ? 32 : favor ? 16 : d;
      auto prefix_of = [&] {
        return empty_prefix ? empty_state<double>({1, 2, m, dv + 2}, favor) : key_state<double>(x0.k, x0.v, o, proj);
      };
      auto loss = [&] {
        const auto r = causal_from_state<double>(x.q, x.k, x.v, prefix_of(), o, proj, lengths);
        return testing::dot_loss(r.out, G1) + testing::dot_loss(apply_state<double>(q2, r.state, o, proj).out, G2);
      };
      const auto prefix = prefix_of();
      const auto r = causal_from_state<double>(x.q, x.k, x.v, prefix, o, proj, lengths);
      const auto a = apply_state<double>(q2, r.state, o, proj);
      const auto ga = apply_state_backward<double>(q2, r.state, G2, a.out, a.den, o, proj);
      const auto gc = causal_from_state_backward<double>(x.q, x.k, x.v, prefix, G1, r.out, r.den,
                                                         ga.dstate.view(), o, proj, lengths);
      for (int64_t row = 0; row < 2 * m; ++row) ASSERT_EQ(gc.dstate[row * (dv + 2) + dv + 1], 0) << "shift of dprefix";
      testing::expect_gradient(x.q, gc.dq, loss, "dq");
      testing::expect_gradient(x.k, gc.dk, loss, "dk");
      testing::expect_gradient(x.v, gc.dv, loss, "dv");
      testing::expect_gradient(q2, ga.dq, loss, "dq of the state's queries");
      if (!empty_prefix) {
        const auto g0 = key_state_backward<double>(x0.k, x0.v, prefix, gc.dstate, o, proj);
        testing::expect_gradient(x0.k, g0.dk, loss, "dk of the prefix's keys");
        testing::expect_gradient(x0.v, g0.dv, loss, "dv of the prefix's keys");
      }
      // Without dstate_after, the gradients are those of Σ G1∘out alone.
      const auto g_out = causal_from_state_backward<double>(x.q, x.k, x.v, prefix, G1, r.out, r.den, std::nullopt,
                                                            o, proj, lengths);
      auto loss_out = [&] {
        return testing::dot_loss(causal_from_state<double>(x.q, x.k, x.v, prefix_of(), o, proj, lengths).out, G1);
      };
      testing::expect_gradient(x.q, g_out.dq, loss_out, "dq without dstate_after");
      testing::expect_gradient(x.k, g_out.dk, loss_out, "dk without dstate_after");
      testing::expect_gradient(x.v, g_out.dv, loss_out, "dv without dstate_after");
    }
}

// ---- bad input -------------------------------------------------------------------------------

TEST(StateOps, BadInputIsAnError) {
  const Inputs x = inputs("elu", 1, 2, 6, 4, 3, 70);
  const StateOptions elu;
  const auto state = key_state<double>(x.k, x.v, elu);
  EXPECT_THAT(error_of([&] { key_state<double>(x.k, rows(x.v, 0, 5), elu); }), HasSubstr("key_state: v must be [1, 2, 6, value_dim]"));
  EXPECT_THAT(error_of([&] { key_state<double>(x.k, x.v, elu, std::nullopt, std::vector<int64_t>{7}); }),
              HasSubstr("key_lengths must be in [0, 6], got 7"));
  EXPECT_THAT(error_of([&] { key_state<double>(x.k, x.v, elu, x.w.view()); }),
              HasSubstr("projection is only used with feature_map=\"favor\""));
  StateOptions favor = recurrent_options("positive");
  EXPECT_THAT(error_of([&] { key_state<double>(x.k, x.v, favor); }), HasSubstr("needs a projection"));
  StateOptions bad_map;
  bad_map.feature_map = "gelu";
  EXPECT_THAT(error_of([&] { key_state<double>(x.k, x.v, bad_map); }), HasSubstr("gelu"));
  Tensor<double> nan_q = cast<double>(x.q);
  nan_q[5] = std::nan("");
  EXPECT_THAT(error_of([&] { apply_state<double>(nan_q, state, elu); }), HasSubstr("apply_state: q"));
  EXPECT_THAT(error_of([&] { apply_state<double>(x.q, rows(state, 0, 3), elu); }),
              HasSubstr("apply_state: state has shape [1, 2, 3, 5]; expected [1, 2, 4, 5]"));
  Tensor<double> shifted = cast<double>(state);
  shifted[4] = 1;  // a shift, for a plain map
  EXPECT_THAT(error_of([&] { apply_state<double>(x.q, shifted, elu); }), HasSubstr("is a shift, which is 0"));
  const auto fstate = key_state<double>(x.k, x.v, favor, x.w.view());
  Tensor<double> orphan = cast<double>(fstate);
  orphan[orphan.dim(3) - 1] = -std::numeric_limits<double>::infinity();  // no key, but S_0 != 0
  EXPECT_THAT(error_of([&] { apply_state<double>(x.q, orphan, favor, x.w.view()); }),
              HasSubstr("in a row whose shift is -inf (no key); expected 0"));
  Tensor<double> inf_state = cast<double>(state);
  inf_state[0] = std::numeric_limits<double>::infinity();
  EXPECT_THAT(error_of([&] { causal_from_state<double>(x.q, x.k, x.v, inf_state, elu); }),
              HasSubstr("causal_from_state: prefix[0] = inf; expected a finite value"));
  const auto r = apply_state<double>(x.q, state, elu);
  EXPECT_THAT(error_of([&] { apply_state_backward<double>(x.q, state, rows(r.out, 0, 2), r.out, r.den, elu); }),
              HasSubstr("apply_state_backward: dout"));
  EXPECT_THAT(error_of([&] { key_state_backward<double>(x.k, x.v, state, rows(state, 0, 2), elu); }),
              HasSubstr("key_state_backward: dstate"));
  const auto cr = causal_from_state<double>(x.q, x.k, x.v, state, elu);
  EXPECT_THAT(error_of([&] {
                causal_from_state_backward<double>(x.q, x.k, x.v, state, cr.out, cr.out, rows(cr.out, 0, 1), std::nullopt, elu);
              }),
              HasSubstr("causal_from_state_backward: den"));
  EXPECT_THAT(error_of([&] {
                causal_from_state_backward<double>(x.q, x.k, x.v, state, cr.out, cr.out, cr.den, rows(state, 0, 1).view(), elu);
              }),
              HasSubstr("causal_from_state_backward: dstate_after"));
  StateOptions neg_eps;
  neg_eps.eps = -1;
  EXPECT_THAT(error_of([&] { key_state<double>(x.k, x.v, neg_eps); }), HasSubstr("eps must be finite and >= 0"));
  // Sums beyond the dtype's range are an error, never inf.
  Tensor<float> big_v = cast<float>(x.v);
  for (int64_t i = 0; i < big_v.size(); ++i) big_v[i] = 3e38f;
  EXPECT_THAT(error_of([&] { key_state<float>(cast<float>(x.k), big_v, elu); }), HasSubstr("overflows float32"));
}

}  // namespace
}  // namespace linattn
