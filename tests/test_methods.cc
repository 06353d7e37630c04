// Every registered method (include/linattn/registry.h), through the registry: the same results
// for every thread count, above and below batch·heads; values near the dtype's limit; inputs too
// large for the dtype give an error, never inf or NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <optional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "linattn/linattn.h"
#include "linattn/reference_registry.h"
#include "softmax_bounds.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::random_tensor;
using testing::ScopedThreads;

// One registered method, causal or not, with batch B and H heads: what a test runs.
struct Variant {
  const MethodInfo* method;
  bool causal;
  int64_t batch, heads;
};

void PrintTo(const Variant& v, std::ostream* os) {
  *os << v.method->name << (v.causal ? " causal" : "") << " B=" << v.batch << " H=" << v.heads;
}

std::vector<Variant> variants() {
  std::vector<Variant> out;
  for (const MethodInfo& m : methods())
    for (bool causal : {false, true}) {
      if (causal && !m.no_causal.empty()) continue;
      for (auto [b, h] : {std::pair<int64_t, int64_t>{1, 1}, {1, 2}, {3, 1}}) out.push_back({&m, causal, b, h});
    }
  return out;
}

std::string variant_name(const ::testing::TestParamInfo<Variant>& p) {
  return p.param.method->name + (p.param.causal ? "_causal" : "") + "_B" + std::to_string(p.param.batch) +
         "_H" + std::to_string(p.param.heads);
}

// A call of the variant on random inputs of n positions: q, k, v, dout and its extra tensors,
// owned here, and the MethodArgs viewing them.
template <class T>
struct Call {
  Tensor<T> q, k, v, dout;
  std::vector<std::pair<std::string, Tensor<T>>> extra;
  MethodArgs<T> args;

  Call(const Variant& x, int64_t n, int64_t d, uint64_t seed, double q_scale = 1, double v_scale = 1)
      : q(testing::cast<T>(random_tensor<double>({x.batch, x.heads, n, d}, seed, q_scale))),
        k(testing::cast<T>(random_tensor<double>({x.batch, x.heads, n, d}, seed + 1, q_scale))),
        v(testing::cast<T>(random_tensor<double>({x.batch, x.heads, n, d}, seed + 2, v_scale))),
        dout(testing::cast<T>(random_tensor<double>({x.batch, x.heads, n, d}, seed + 3))),
        extra(x.method->functions<T>().example_tensors(x.heads, d, n, 0, seed + 4)) {
    refresh(x);
  }
  void refresh(const Variant& x) {
    args = {};
    args.q = q, args.k = k, args.v = v;
    args.options["causal"] = x.causal;
    for (const auto& [name, t] : extra) args.tensors[name] = t.view();
  }
};

// The forward's saved tensors have the shapes the registry's saved_dims give (what PyTorch's
// fake tensors are made from), and the backward from them is bitwise the one that recomputes
// the forward.
template <class T>
void expect_saved_consistent(const MethodInfo& m, const Call<T>& c, const MethodOutput<T>& out,
                             const AttentionGrads<T>& recomputed) {
  ASSERT_EQ(out.saved.size(), m.saved.size()) << m.name;
  ASSERT_EQ(m.saved_dims.size(), m.saved.size()) << m.name;
  std::map<std::string, Shape, std::less<>> tensor_shapes;
  for (const auto& [name, t] : c.args.tensors) tensor_shapes[name] = t.shape;
  const Shape& qs = c.q.shape();
  std::map<std::string, TensorView<const T>, std::less<>> saved{{"out", out.out.view()}};
  for (size_t i = 0; i < m.saved.size(); ++i) {
    ASSERT_EQ(out.saved[i].first, m.saved[i]);
    Shape want;
    for (const std::string& token : m.saved_dims[i]) {
      if (token == "batch") want.push_back(qs[0]);
      else if (token == "heads") want.push_back(qs[1]);
      else if (token == "n_q") want.push_back(qs[2]);
      else if (token == "value_dim+2") want.push_back(c.v.shape()[3] + 2);
      else if (token == "features") want.push_back(m.feature_dim(qs[3], tensor_shapes, c.args.options));
      else FAIL() << m.name << ": unknown dimension token " << token;
    }
    EXPECT_EQ(out.saved[i].second.shape(), want) << m.name << " " << m.saved[i];
    saved[m.saved[i]] = out.saved[i].second.view();
  }
  if (m.saved.empty()) return;
  const AttentionGrads<T> g = m.functions<T>().backward(c.args, c.dout, saved);
  testing::expect_identical(g.dq, recomputed.dq, "dq from saved");
  testing::expect_identical(g.dk, recomputed.dk, "dk from saved");
  testing::expect_identical(g.dv, recomputed.dv, "dv from saved");
  ASSERT_EQ(g.params.size(), recomputed.params.size());
  for (size_t i = 0; i < g.params.size(); ++i)
    testing::expect_identical(g.params[i].second, recomputed.params[i].second, g.params[i].first + " from saved");
}

class EveryMethod : public ::testing::TestWithParam<Variant> {};

// Thread counts {1, 2, 3, 8, 16} against batch·heads {1, 2, 3}, with sequences longer than the
// method's largest block: every output and gradient bitwise the same as with one thread. The
// one exception by design: exact attention's backward splits the keys of each (batch, head)
// across workers when there are fewer (batch, heads) than threads, and adds the partial dq in
// a different association; there dq is checked to be within the derived rounding bound of the
// float64 value (softmax_bounds.h) at every thread count, as it is at one thread.
TEST_P(EveryMethod, SameResultsForEveryThreadCount) {
  const Variant x = GetParam();
  const int64_t n = x.method->block_rows + 37, d = 16;
  Call<float> c(x, n, d, 7);
  const auto& f = x.method->f32;
  std::optional<MethodOutput<float>> out1;
  std::optional<AttentionGrads<float>> grads1;
  struct OwnThreadsAfter {
    ~OwnThreadsAfter() { use_own_threads(); }
  } own_threads_after;
  // Each thread count on linattn's own helpers, then on an OpenMP team (as under linattn.torch).
  for (int run = 0; run < 10; ++run) {
    const int threads = std::array{1, 2, 3, 8, 16}[static_cast<size_t>(run % 5)];
    if (run == 5) {
      ASSERT_NE(testing::share_system_openmp().find("libgomp"), std::string::npos);
    }
    SCOPED_TRACE(::testing::Message() << threads << " threads on " << thread_pool());
    ScopedThreads scope(threads);
    MethodOutput<float> out = f.forward(c.args);
    AttentionGrads<float> g = f.backward(c.args, c.dout, {});
    expect_saved_consistent(*x.method, c, out, g);
    if (!out1) {
      out1 = std::move(out);
      grads1 = std::move(g);
      continue;
    }
    testing::expect_identical(out.out, out1->out, "out");
    for (size_t i = 0; i < out.saved.size(); ++i) testing::expect_identical(out.saved[i].second, out1->saved[i].second, out.saved[i].first);
    testing::expect_identical(g.dk, grads1->dk, "dk");
    testing::expect_identical(g.dv, grads1->dv, "dv");
    ASSERT_EQ(g.params.size(), grads1->params.size());
    for (size_t i = 0; i < g.params.size(); ++i) testing::expect_identical(g.params[i].second, grads1->params[i].second, g.params[i].first);
    if (x.method->exact && x.batch * x.heads < threads) {
      AttentionOptions o;
      o.causal = x.causal;
      const auto exact = testing::softmax_exact_with_bounds<float>(testing::cast<double>(c.q), testing::cast<double>(c.k),
                                                                   testing::cast<double>(c.v), testing::cast<double>(c.dout), o);
      testing::expect_within(g.dq, exact.dq, exact.dq_bound, "dq");
      testing::expect_within(grads1->dq, exact.dq, exact.dq_bound, "dq (1 thread)");
    } else {
      testing::expect_identical(g.dq, grads1->dq, "dq");
    }
  }
}

// v with entries up to float32's largest finite value: computed on a copy scaled by a power of
// two, so the output (and, with dout scaled too, every gradient) is bitwise the ordinary result
// times that power of two (range.h), not inf or NaN.
TEST_P(EveryMethod, ValuesNearTheDtypeLimitScaleExactly) {
  const Variant x = GetParam();
  const int64_t n = 40, d = 8;
  Call<float> c(x, n, d, 11);
  // Ordinary v with max |v| in [2^31, 2^32): the library computes it as it is.
  float vmax = 0;
  for (int64_t i = 0; i < c.v.size(); ++i) vmax = std::max(vmax, std::abs(c.v[i]));
  const int shift = 31 - std::ilogb(vmax);
  for (int64_t i = 0; i < c.v.size(); ++i) c.v[i] = std::ldexp(c.v[i], shift);
  const MethodOutput<float> small = x.method->f32.forward(c.args);
  const AttentionGrads<float> small_g = x.method->f32.backward(c.args, c.dout, {});
  // The same times 2^96: max |v| in [2^127, 2^128), next to FLT_MAX.
  Tensor<float> big_v(c.v.shape()), big_dout(c.dout.shape());
  for (int64_t i = 0; i < c.v.size(); ++i) big_v[i] = std::ldexp(c.v[i], 96);
  float gmax = 0;
  for (int64_t i = 0; i < c.dout.size(); ++i) gmax = std::max(gmax, std::abs(c.dout[i]));
  const int gshift = 127 - std::ilogb(gmax);  // dout near the limit too
  for (int64_t i = 0; i < c.dout.size(); ++i) big_dout[i] = std::ldexp(c.dout[i], gshift);
  MethodArgs<float> big = c.args;
  big.v = big_v;
  const MethodOutput<float> out = x.method->f32.forward(big);
  for (int64_t i = 0; i < out.out.size(); ++i) {
    ASSERT_TRUE(std::isfinite(out.out[i])) << i;
    ASSERT_EQ(out.out[i], std::ldexp(small.out[i], 96)) << i;
  }
  // Gradients: dv scales with dout alone; dq, dk and parameter gradients with v and dout, and
  // may leave the range (then an Error says so). Here dout is scaled to 2^127: compare the
  // scale-invariant dv, and check the others are finite or refused.
  try {
    const AttentionGrads<float> g = x.method->f32.backward(big, big_dout, {});
    for (int64_t i = 0; i < g.dv.size(); ++i) {
      ASSERT_TRUE(std::isfinite(g.dv[i]));
      ASSERT_EQ(g.dv[i], std::ldexp(small_g.dv[i], gshift)) << "dv " << i;
    }
    for (const Tensor<float>* t : {&g.dq, &g.dk})
      for (int64_t i = 0; i < t->size(); ++i) ASSERT_TRUE(std::isfinite((*t)[i]));
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("overflows float32"), std::string::npos) << e.what();
  }
}

// q and k of magnitude 1e30 in float32: a finite result or an Error that says the inputs are
// too large (or that something overflows), never inf or NaN.
TEST_P(EveryMethod, HugeQueriesAndKeysGiveAFiniteResultOrAnError) {
  const Variant x = GetParam();
  Call<float> c(x, 30, 8, 13, 1e30);
  auto finite = [](const Tensor<float>& t) {
    for (int64_t i = 0; i < t.size(); ++i)
      if (!std::isfinite(t[i])) return false;
    return true;
  };
  auto acceptable_error = [](const std::string& m) {
    return m.find("too large") != std::string::npos || m.find("overflow") != std::string::npos;
  };
  try {
    EXPECT_TRUE(finite(x.method->f32.forward(c.args).out));
  } catch (const Error& e) {
    EXPECT_TRUE(acceptable_error(e.what())) << e.what();
  }
  try {
    const AttentionGrads<float> g = x.method->f32.backward(c.args, c.dout, {});
    EXPECT_TRUE(finite(g.dq) && finite(g.dk) && finite(g.dv));
  } catch (const Error& e) {
    EXPECT_TRUE(acceptable_error(e.what())) << e.what();
  }
}

// Options the method does not take, and options of the wrong kind, are errors naming them.
TEST_P(EveryMethod, UnknownAndMistypedOptionsAreErrors) {
  const Variant x = GetParam();
  Call<float> c(x, 8, 4, 1);
  MethodArgs<float> a = c.args;
  a.options["no_such_option"] = true;
  EXPECT_NE(testing::error_of([&] { x.method->f32.forward(a); }).find("unknown option \"no_such_option\""),
            std::string::npos);
  a = c.args;
  a.options["causal"] = int64_t{1};
  EXPECT_NE(testing::error_of([&] { x.method->f32.forward(a); }).find("causal must be True or False"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(All, EveryMethod, ::testing::ValuesIn(variants()), variant_name);

TEST(Registry, NamesAndFunctionsAreUniqueAndFoundByName) {
  std::set<std::string> names, functions;
  for (const MethodInfo& m : methods()) {
    EXPECT_TRUE(names.insert(m.name).second) << m.name;
    EXPECT_TRUE(functions.insert(m.function).second) << m.function;
    EXPECT_EQ(&method(m.name), &m);
    EXPECT_NO_THROW(reference::reference_of(m.name)) << m.name;
    EXPECT_GT(m.block_rows, 0) << m.name;
    EXPECT_TRUE(m.size_name.empty() || m.default_size > 0) << m.name;
  }
  EXPECT_NE(testing::error_of([] { method("no_such_method"); }).find("the methods are softmax"), std::string::npos);
  EXPECT_EQ(std::count_if(methods().begin(), methods().end(), [](const MethodInfo& m) { return m.exact; }), 1);
}

// Each method's docs page exists and names the function and every option: the registry and the
// documentation say the same things.
TEST(Registry, DocsDescribeEveryMethodAndOption) {
  for (const MethodInfo& m : methods()) {
    const std::filesystem::path page = std::filesystem::path(LINATTN_SOURCE_DIR) / m.docs;
    std::ifstream f(page);
    ASSERT_TRUE(f) << m.name << ": no page " << page;
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find(m.function), std::string::npos) << page << " does not name " << m.function;
    for (const OptionInfo& o : m.options)
      EXPECT_NE(text.find(o.name), std::string::npos) << page << " does not describe option " << o.name;
  }
  std::ifstream guide(std::filesystem::path(LINATTN_SOURCE_DIR) / "docs/adding-a-method.md");
  ASSERT_TRUE(guide) << "docs/adding-a-method.md is missing";
  const std::string text((std::istreambuf_iterator<char>(guide)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("methods.def"), std::string::npos);
}

}  // namespace
}  // namespace linattn
