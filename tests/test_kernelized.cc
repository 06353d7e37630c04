// Kernelized attention (linear_attention, favor_attention): fast path against the float64
// reference within derived bounds, gradients against finite differences, the depthwise
// convolution, large norms, masks, bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernelized_bounds.h"
#include "linattn/random_features.h"
#include "linattn/kernelized/args.h"
#include "linattn/kernelized/engine.h"
#include "linattn/kernelized/products_calls.h"
#include "linattn/kernelized.h"
#include "linattn/kernelized/reference.h"
#include "linattn/registry.h"
#include "linattn/core/products.h"
#include "linattn/low_precision.h"
#include "test_util.h"

namespace linattn {
namespace {

using ::testing::HasSubstr;
using testing::cast;
using testing::error_of;
using testing::expect_within;
using testing::expect_gradient;
using testing::KernelizedSpec;
using testing::random_tensor;
using testing::ScopedThreads;

struct Size {
  int64_t n_q, n_k, d, dv;
};

enum class Mask { None, Causal, KeyLengths, CausalKeyLengths };
const char* const kMaskNames[] = {"none", "causal", "key_lengths", "causal_key_lengths"};
void PrintTo(const Size& z, std::ostream* os) {
  *os << "n_q=" << z.n_q << " n_k=" << z.n_k << " d=" << z.d << " d_v=" << z.dv;
}
void PrintTo(Mask m, std::ostream* os) { *os << kMaskNames[static_cast<int>(m)]; }

KernelizedSpec spec_for(const std::string& map, Mask mask, int64_t batch, int64_t n_k) {
  KernelizedSpec s;
  s.map = map;
  s.causal = mask == Mask::Causal || mask == Mask::CausalKeyLengths;
  if (mask == Mask::KeyLengths || mask == Mask::CausalKeyLengths) {
    std::vector<int64_t> l;
    for (int64_t b = 0; b < batch; ++b) l.push_back(b == 0 ? n_k : b == 1 ? 0 : (n_k * 2) / 3);
    s.key_lengths = l;
  }
  return s;
}

template <class T>
Tensor<T> run_forward(const KernelizedSpec& s, const Tensor<T>& q, const Tensor<T>& k,
                      const Tensor<T>& v, const Tensor<T>* w) {
  if (s.favor()) return favor_attention<T>(q, k, v, *w, s.favor_options());
  return linear_attention<T>(q, k, v, s.linear_options());
}

template <class T>
AttentionGrads<T> run_backward(const KernelizedSpec& s, const Tensor<T>& q, const Tensor<T>& k,
                               const Tensor<T>& v, const Tensor<T>& dout, const Tensor<T>* w) {
  if (s.favor()) return favor_attention_backward<T>(q, k, v, *w, dout, s.favor_options());
  auto g = linear_attention_backward<T>(q, k, v, dout, s.linear_options());
  return g;
}

template <class T>
KernelizedAttentionResult<T> run_forward_saved(const KernelizedSpec& s, const Tensor<T>& q, const Tensor<T>& k,
                                               const Tensor<T>& v, const Tensor<T>* w) {
  if (s.favor()) return favor_attention_with_saved<T>(q, k, v, *w, s.favor_options());
  return linear_attention_with_saved<T>(q, k, v, s.linear_options());
}

template <class T>
AttentionGrads<T> run_backward_saved(const KernelizedSpec& s, const Tensor<T>& q, const Tensor<T>& k,
                                     const Tensor<T>& v, const Tensor<T>& dout, const Tensor<T>* w,
                                     const KernelizedAttentionResult<T>& f) {
  if (s.favor()) return favor_attention_backward<T>(q, k, v, *w, dout, f.out, f.den, f.state, s.favor_options());
  return linear_attention_backward<T>(q, k, v, dout, f.out, f.den, f.state, s.linear_options());
}

// The backward from the forward's saved tensors does the same arithmetic as the one that runs
// the forward itself first (engine.cc): bitwise the same gradients, and the same output.
template <class T>
void expect_saved_path_identical(const KernelizedSpec& s, const Tensor<T>& q, const Tensor<T>& k,
                                 const Tensor<T>& v, const Tensor<T>& dout, const Tensor<T>* w,
                                 const Tensor<T>& out, const AttentionGrads<T>& g) {
  const auto f = run_forward_saved<T>(s, q, k, v, w);
  testing::expect_identical(f.out, out, "out with saved");
  const auto gs = run_backward_saved<T>(s, q, k, v, dout, w, f);
  testing::expect_identical(gs.dq, g.dq, "dq from saved");
  testing::expect_identical(gs.dk, g.dk, "dk from saved");
  testing::expect_identical(gs.dv, g.dv, "dv from saved");
}

// The given map takes features, which are >= 0: |x| for it, x as it is for the others.
Tensor<double> given_features(const std::string& map, Tensor<double> x) {
  if (map == "given")
    for (int64_t i = 0; i < x.size(); ++i) x[i] = std::abs(x[i]);
  return x;
}

class KernelizedVsReference
    : public ::testing::TestWithParam<std::tuple<std::string, Mask, Size>> {};

template <class T>
void check(const std::string& map, Mask mask, const Size& z, uint64_t seed) {
  const int64_t B = 3, H = 2;
  const KernelizedSpec spec = spec_for(map, mask, B, z.n_k);
  const auto q = cast<T>(given_features(map, random_tensor<double>({B, H, z.n_q, z.d}, seed)));
  const auto k = cast<T>(given_features(map, random_tensor<double>({B, H, z.n_k, z.d}, seed + 1)));
  const auto v = cast<T>(random_tensor<double>({B, H, z.n_k, z.dv}, seed + 2));
  const auto dout = cast<T>(random_tensor<double>({B, H, z.n_q, z.dv}, seed + 3));
  const auto w = random_features<T>(24, z.d, FeatureKind::Orthogonal, seed + 4);
  const Tensor<double> wd = cast<double>(w);
  const auto exact = testing::kernelized_exact_with_bounds<T>(
      cast<double>(q), cast<double>(k), cast<double>(v), cast<double>(dout), &wd, spec);
  for (int threads : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << map << " threads=" << threads << " T=" << sizeof(T) * 8);
    ScopedThreads scope(threads);
    const auto out = run_forward<T>(spec, q, k, v, &w);
    expect_within(out, exact.out, exact.out_bound, "out");
    const auto g = run_backward<T>(spec, q, k, v, dout, &w);
    expect_within(g.dq, exact.dq, exact.dq_bound, "dq");
    expect_within(g.dk, exact.dk, exact.dk_bound, "dk");
    expect_within(g.dv, exact.dv, exact.dv_bound, "dv");
    expect_saved_path_identical<T>(spec, q, k, v, dout, &w, out, g);
  }
}

TEST_P(KernelizedVsReference, Float32) {
  const auto& [map, mask, z] = GetParam();
  check<float>(map, mask, z, 10 + z.n_q);
}
TEST_P(KernelizedVsReference, Float64) {
  const auto& [map, mask, z] = GetParam();
  check<double>(map, mask, z, 20 + z.n_k);
}

std::string kernelized_name(const ::testing::TestParamInfo<KernelizedVsReference::ParamType>& p) {
  const Size& z = std::get<2>(p.param);
  return std::get<0>(p.param) + "_" + kMaskNames[int(std::get<1>(p.param))] + "_n" +
         std::to_string(z.n_q) + "_d" + std::to_string(z.d) + "_dv" + std::to_string(z.dv);
}

// Sizes from the engine's: 1 and 7 inside a causal chunk, two chunks and a bit, and 300 (4.7
// chunks); DifferentQueryAndKeyLengths below crosses the non-causal block.
INSTANTIATE_TEST_SUITE_P(
    All, KernelizedVsReference,
    ::testing::Combine(::testing::Values("elu", "relu", "given", "focused", "positive", "hyperbolic", "trig"),
                       ::testing::Values(Mask::None, Mask::Causal, Mask::KeyLengths,
                                         Mask::CausalKeyLengths),
                       ::testing::Values(Size{1, 1, 16, 16}, Size{7, 7, 16, 8},
                                         Size{2 * kernelized::kChunk + 2, 2 * kernelized::kChunk + 2, 32, 24},
                                         Size{300, 300, 16, 16})),
    kernelized_name);

void expect_same_bits(const Tensor<bfloat16>& got, const Tensor<bfloat16>& want, const char* what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  for (int64_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i].bits, want[i].bits) << what << ": element " << i;
}

void expect_same_values(const Tensor<float>& got, const Tensor<float>& want, const char* what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  for (int64_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i])) << what << ": element " << i;
}

Tensor<float> widened(const Tensor<bfloat16>& x) { return widen(TensorView<const bfloat16>(x.view())); }

// A bfloat16 call of `method` (map: linear's feature_map or favor's kernel) on the bfloat16
// values of q, k, v, with the spec's mask; projection w for favor.
MethodArgs<bfloat16> bf16_args(const std::string& method_name, const KernelizedSpec& spec, const Tensor<bfloat16>& q,
                               const Tensor<bfloat16>& k, const Tensor<bfloat16>& v, const Tensor<bfloat16>* w) {
  MethodArgs<bfloat16> a;
  a.q = q, a.k = k, a.v = v;
  a.options["causal"] = spec.causal;
  if (spec.key_lengths) a.options["key_lengths"] = *spec.key_lengths;
  if (method_name == "favor") {
    a.options["kernel"] = spec.map;
    a.tensors["projection"] = *w;
  } else {
    a.options["feature_map"] = spec.map;
  }
  return a;
}

// The same call in float32 on the widened values (the registry's widened path).
MethodArgs<float> widened_args(const MethodArgs<bfloat16>& a, std::vector<Tensor<float>>& storage) {
  storage.reserve(8);
  auto keep = [&](TensorView<const bfloat16> t) {
    storage.push_back(widen(t));
    return storage.back().view();
  };
  MethodArgs<float> w;
  w.q = keep(a.q), w.k = keep(a.k), w.v = keep(a.v);
  w.options = a.options;
  for (const auto& [name, t] : a.tensors) w.tensors[name] = keep(t);
  return w;
}

// The products a bfloat16 call of the registry takes (register.cc): bfloat16 on AVX512-BF16,
// except for FAVOR's trig kernel.
Products registry_products(const std::string& map) {
  return bfloat16_products_usable() && map != "trig" ? Products::Bfloat16 : Products::Native;
}

// The float32 call on widened arguments a32 (widened_args) with the given products: the
// arithmetic a bfloat16 call of the registry must reproduce, rounded.
MethodOutput<float> widened_forward(const std::string& method_name, Products products, const MethodArgs<float>& a32) {
  KernelizedAttentionResult<float> r;
  if (method_name == "favor") {
    const auto c = kernelized::favor_call(a32);
    r = kernelized::favor_forward(products, a32.q, a32.k, a32.v, c.projection, c.opts);
  } else {
    const auto c = kernelized::linear_call(a32);
    r = kernelized::linear_forward(products, a32.q, a32.k, a32.v, c.opts, c.conv_weight);
  }
  MethodOutput<float> out{std::move(r.out), {}};
  out.saved.emplace_back("den", std::move(r.den));
  out.saved.emplace_back("state", std::move(r.state));
  return out;
}

AttentionGrads<float> widened_backward(const std::string& method_name, Products products, const MethodArgs<float>& a32,
                                       TensorView<const float> dout, const SavedViews<float>& saved) {
  std::optional<kernelized::SavedResults<float>> s;
  if (!saved.empty()) s = kernelized::SavedResults<float>{saved.at("out"), saved.at("den"), saved.at("state")};
  if (method_name == "favor") {
    const auto c = kernelized::favor_call(a32);
    return kernelized::favor_backward(products, a32.q, a32.k, a32.v, c.projection, dout, s, c.opts);
  }
  const auto c = kernelized::linear_call(a32);
  return kernelized::linear_backward(products, a32.q, a32.k, a32.v, dout, s, c.opts, c.conv_weight);
}

// linear_attention's maps and FAVOR's kernels with bfloat16 products (its trig kernel keeps float32's).
struct Bf16ProductCase {
  const char* method;
  const char* map;
};
constexpr Bf16ProductCase kBf16ProductCases[] = {{"linear", "elu"},     {"linear", "relu"},      {"linear", "focused"},
                                                 {"linear", "given"}, {"favor", "positive"}, {"favor", "hyperbolic"}};

// bfloat16 calls with bfloat16 products (AVX512-BF16): the registry's bfloat16 linear_attention
// (every map) and favor_attention (positive, hyperbolic), against the float64 reference on the
// same bfloat16 values, within the float32 bound plus the operand roundings (kernelized_bounds.h,
// bf16_products) plus the result's own rounding to bfloat16 (u_b·(|ref| + bound)). Every mask,
// sizes inside one causal chunk, across chunks and across 300 rows, at 1 and 5 threads
// (batch·heads 6), with and without the forward's saved tensors (whose out is the rounded
// bfloat16 one). Every product call of the engine and the feature maps runs here.
TEST(KernelizedBf16Products, MatchTheBoundAgainstFloat64) {
  if (!bfloat16_products_usable()) GTEST_SKIP() << "no AVX512-BF16 here";
  const double ub = std::ldexp(1.0, -8);
  auto rounded = [](Tensor<double> x) {
    for (int64_t i = 0; i < x.size(); ++i) x[i] = to_float(to_bfloat16(static_cast<float>(x[i])));
    return x;
  };
  auto to_bf16 = [](const Tensor<double>& x) { return testing::narrowed<bfloat16>(x); };
  auto check_within = [&](const Tensor<bfloat16>& got, const Tensor<double>& want, const Tensor<double>& bound32,
                          const char* what) {
    Tensor<double> bound(bound32.shape());
    for (int64_t i = 0; i < bound.size(); ++i) bound[i] = bound32[i] + ub * (std::abs(want[i]) + bound32[i]);
    expect_within(widen(TensorView<const bfloat16>(got.view())), want, bound, what);
  };
  for (const Bf16ProductCase c : kBf16ProductCases)
    for (Mask mask : {Mask::None, Mask::Causal, Mask::KeyLengths, Mask::CausalKeyLengths})
      for (const Size z : {Size{7, 7, 16, 8}, Size{2 * kernelized::kChunk + 2, 2 * kernelized::kChunk + 2, 32, 24},
                           Size{300, 300, 16, 16}}) {
        const int64_t B = 3, H = 2;
        const KernelizedSpec spec = spec_for(c.map, mask, B, z.n_k);
        const uint64_t seed = 40 + z.n_q;
        const auto q = rounded(given_features(c.map, random_tensor<double>({B, H, z.n_q, z.d}, seed)));
        const auto k = rounded(given_features(c.map, random_tensor<double>({B, H, z.n_k, z.d}, seed + 1)));
        const auto v = rounded(random_tensor<double>({B, H, z.n_k, z.dv}, seed + 2));
        const auto dout = rounded(random_tensor<double>({B, H, z.n_q, z.dv}, seed + 3));
        const auto w = rounded(random_features<double>(24, z.d, FeatureKind::Orthogonal, seed + 4));
        const auto exact = testing::kernelized_exact_with_bounds<float>(q, k, v, dout, &w, spec, true);
        const Tensor<bfloat16> qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v), gb = to_bf16(dout), wb = to_bf16(w);
        const MethodArgs<bfloat16> a = bf16_args(c.method, spec, qb, kb, vb, &wb);
        const MethodInfo& m = method(c.method);
        for (int threads : {1, 5}) {
          SCOPED_TRACE(::testing::Message() << c.method << " " << c.map << " " << kMaskNames[int(mask)]
                                            << " n=" << z.n_q << " threads=" << threads);
          ScopedThreads scope(threads);
          ASSERT_TRUE(m.bf16_kernel(a).has_value());
          const MethodOutput<bfloat16> f = m.bf16.forward(a);
          check_within(f.out, exact.out, exact.out_bound, "out");
          const AttentionGrads<bfloat16> g = m.bf16.backward(a, gb, {});
          check_within(g.dq, exact.dq, exact.dq_bound, "dq");
          check_within(g.dk, exact.dk, exact.dk_bound, "dk");
          check_within(g.dv, exact.dv, exact.dv_bound, "dv");
          const Tensor<float> out_wide = widen(TensorView<const bfloat16>(f.out.view()));
          SavedViews<bfloat16> saved{{"out", out_wide.view()}};
          for (const auto& [name, t] : f.saved) saved[name] = t.view();
          const AttentionGrads<bfloat16> gs = m.bf16.backward(a, gb, saved);
          check_within(gs.dq, exact.dq, exact.dq_bound, "dq from saved");
          check_within(gs.dk, exact.dk, exact.dk_bound, "dk from saved");
          check_within(gs.dv, exact.dv, exact.dv_bound, "dv from saved");
        }
      }
}

// Thread counts below and above batch·heads (1 to 3): the bfloat16-product calls give bitwise the
// same output and gradients at 1, 3, 8 and 16 threads (each batch·head is one worker's, and its
// products' copies are that worker's own).
TEST(KernelizedBf16Products, ThreadCountsGiveTheSameBits) {
  if (!bfloat16_products_usable()) GTEST_SKIP() << "no AVX512-BF16 here";
  for (const char* method_name : {"linear", "favor"})
    for (const int64_t heads : {1, 2, 3})
      for (const bool causal : {false, true}) {
        const Tensor<bfloat16> q = testing::narrowed<bfloat16>(random_tensor<double>({1, heads, 70, 16}, 1)),
                               k = testing::narrowed<bfloat16>(random_tensor<double>({1, heads, 70, 16}, 2)),
                               v = testing::narrowed<bfloat16>(random_tensor<double>({1, heads, 70, 8}, 3)),
                               dout = testing::narrowed<bfloat16>(random_tensor<double>({1, heads, 70, 8}, 4)),
                               w = testing::narrowed<bfloat16>(random_features<double>(40, 16, FeatureKind::Orthogonal, 5));
        KernelizedSpec spec;
        spec.map = std::string(method_name) == "favor" ? "positive" : "elu";
        spec.causal = causal;
        const MethodArgs<bfloat16> a = bf16_args(method_name, spec, q, k, v, &w);
        const MethodInfo& m = method(method_name);
        std::optional<MethodOutput<bfloat16>> f1;
        std::optional<AttentionGrads<bfloat16>> g1, gs1;
        for (int threads : {1, 3, 8, 16}) {
          SCOPED_TRACE(::testing::Message() << method_name << " heads=" << heads << " causal=" << causal
                                            << " threads=" << threads);
          ScopedThreads scope(threads);
          MethodOutput<bfloat16> f = m.bf16.forward(a);
          AttentionGrads<bfloat16> g = m.bf16.backward(a, dout, {});
          // And from the saved tensors, out as the forward returned it (read a block at a time).
          SavedViews<bfloat16> saved;
          for (const auto& [name, t] : f.saved) saved[name] = t.view();
          saved.out_as_returned = f.out.view();
          AttentionGrads<bfloat16> gs = m.bf16.backward(a, dout, saved);
          if (!f1) {
            f1 = std::move(f), g1 = std::move(g), gs1 = std::move(gs);
            continue;
          }
          expect_same_bits(f.out, f1->out, "out");
          expect_same_bits(g.dq, g1->dq, "dq");
          expect_same_bits(g.dk, g1->dk, "dk");
          expect_same_bits(g.dv, g1->dv, "dv");
          expect_same_bits(gs.dq, gs1->dq, "dq from saved");
          expect_same_bits(gs.dk, gs1->dk, "dk from saved");
          expect_same_bits(gs.dv, gs1->dv, "dv from saved");
        }
      }
}

// bfloat16 calls run the float32 engine on the bfloat16 storage, widening and rounding a block
// at a time, with the products the registry picks (bfloat16 on AVX512-BF16 except for FAVOR's
// trig kernel, float32 otherwise). That is the arithmetic of the widened float32 call with the
// same products, so the results must be its bits once rounded: forward (and the saved den and
// state), backward with and without the saved tensors, every map, every mask, sizes inside one
// causal chunk, across chunks and across a key block (1100 rows), at 1 and 5 threads
// (batch·heads 6).
TEST(KernelizedBf16, StorageCallsGiveTheWidenedCallsBits) {
  std::vector<Bf16ProductCase> cases(std::begin(kBf16ProductCases), std::end(kBf16ProductCases));
  cases.push_back({"favor", "trig"});
  const int64_t block = kernelized::kBlockRows + 76, chunks = 2 * kernelized::kChunk + 2;
  for (const Bf16ProductCase c : cases)
    for (Mask mask : {Mask::None, Mask::Causal, Mask::KeyLengths, Mask::CausalKeyLengths})
      for (const Size z : {Size{7, 7, 8, 24}, Size{chunks, chunks, 32, 24}, Size{block, block, 16, 12}}) {
        const int64_t B = 3, H = 2;
        const KernelizedSpec spec = spec_for(c.map, mask, B, z.n_k);
        const uint64_t seed = 70 + z.n_q;
        const double sigma = std::string(c.map) == "trig" ? 0.5 : 1.0;
        auto bf16 = [](const Tensor<double>& x) { return testing::narrowed<bfloat16>(x); };
        const Tensor<bfloat16> q = bf16(given_features(c.map, random_tensor<double>({B, H, z.n_q, z.d}, seed, sigma))),
                               k = bf16(given_features(c.map, random_tensor<double>({B, H, z.n_k, z.d}, seed + 1, sigma))),
                               v = bf16(random_tensor<double>({B, H, z.n_k, z.dv}, seed + 2)),
                               dout = bf16(random_tensor<double>({B, H, z.n_q, z.dv}, seed + 3)),
                               w = bf16(random_features<double>(24, z.d, FeatureKind::Orthogonal, seed + 4));
        const MethodArgs<bfloat16> a = bf16_args(c.method, spec, q, k, v, &w);
        std::vector<Tensor<float>> storage;
        const MethodArgs<float> a32 = widened_args(a, storage);
        const Tensor<float> dout32 = widened(dout);
        const Products products = registry_products(c.map);
        const MethodInfo& m = method(c.method);
        const MethodOutput<float> f32 = widened_forward(c.method, products, a32);
        const Tensor<bfloat16> out_want = narrow<bfloat16>(f32.out, "out");
        const Tensor<float> out_saved = widened(out_want);  // what a caller saves: the rounded output
        SavedViews<float> saved32{{"out", out_saved.view()}};
        for (const auto& [name, t] : f32.saved) saved32[name] = t.view();
        const AttentionGrads<float> g32 = widened_backward(c.method, products, a32, dout32.view(), {});
        const AttentionGrads<float> gs32 = widened_backward(c.method, products, a32, dout32.view(), saved32);
        for (int threads : {1, 5}) {
          SCOPED_TRACE(::testing::Message() << c.method << " " << c.map << " " << kMaskNames[int(mask)] << " n=" << z.n_q
                                            << " threads=" << threads);
          ScopedThreads scope(threads);
          std::optional<MethodOutput<bfloat16>> f = m.bf16_kernel(a);
          ASSERT_TRUE(f.has_value());
          expect_same_bits(f->out, out_want, "out");
          ASSERT_EQ(f->saved.size(), f32.saved.size());
          for (size_t i = 0; i < f->saved.size(); ++i) expect_same_values(f->saved[i].second, f32.saved[i].second, "saved");
          std::optional<AttentionGrads<bfloat16>> g = m.bf16_backward_kernel(a, dout, {});
          ASSERT_TRUE(g.has_value());
          expect_same_bits(g->dq, narrow<bfloat16>(g32.dq, "dq"), "dq");
          expect_same_bits(g->dk, narrow<bfloat16>(g32.dk, "dk"), "dk");
          expect_same_bits(g->dv, narrow<bfloat16>(g32.dv, "dv"), "dv");
          SavedViews<bfloat16> saved{{"out", out_saved.view()}};
          for (const auto& [name, t] : f->saved) saved[name] = t.view();
          std::optional<AttentionGrads<bfloat16>> gs = m.bf16_backward_kernel(a, dout, saved);
          ASSERT_TRUE(gs.has_value());
          expect_same_bits(gs->dq, narrow<bfloat16>(gs32.dq, "dq"), "dq from saved");
          expect_same_bits(gs->dk, narrow<bfloat16>(gs32.dk, "dk"), "dk from saved");
          expect_same_bits(gs->dv, narrow<bfloat16>(gs32.dv, "dv from saved"), "dv from saved");
        }
      }
}

// Where the bfloat16 storage path does not apply, a bfloat16 call runs the widened float32 one
// with the same products (bfloat16 on AVX512-BF16 except for trig), with the same results bit
// for bit: v beyond 2^64 (the float32 code rescales
// it first), dout beyond 2^64, and linear attention with a conv_weight (its convolution reads v
// in float32).
TEST(KernelizedBf16, OutOfRangeValuesAndTheConvolutionWiden) {
  auto bf16 = [](const Tensor<double>& x) { return testing::narrowed<bfloat16>(x); };
  const Tensor<bfloat16> q = bf16(random_tensor<double>({1, 2, 9, 4}, 1)), k = bf16(random_tensor<double>({1, 2, 9, 4}, 2)),
                         v = bf16(random_tensor<double>({1, 2, 9, 3}, 3)), dout = bf16(random_tensor<double>({1, 2, 9, 3}, 4)),
                         w = bf16(random_features<double>(8, 4, FeatureKind::Orthogonal, 5));
  Tensor<bfloat16> big_v = bf16(random_tensor<double>({1, 2, 9, 3}, 3)), big_dout = bf16(random_tensor<double>({1, 2, 9, 3}, 4));
  big_v[5] = to_bfloat16(0x1p70f);
  big_dout[4] = to_bfloat16(-0x1p70f);
  auto expect_widened = [&](const char* name, const std::string& map, const MethodArgs<bfloat16>& a,
                            const Tensor<bfloat16>& g) {
    const MethodInfo& m = method(name);
    std::vector<Tensor<float>> storage;
    const MethodArgs<float> a32 = widened_args(a, storage);
    const Tensor<float> g32 = widened(g);
    const Products products = registry_products(map);
    expect_same_bits(m.bf16.forward(a).out, narrow<bfloat16>(widened_forward(name, products, a32).out, "out"), "out");
    const AttentionGrads<bfloat16> got = m.bf16.backward(a, g, {});
    const AttentionGrads<float> want = widened_backward(name, products, a32, g32.view(), {});
    expect_same_bits(got.dq, narrow<bfloat16>(want.dq, "dq"), "dq");
    expect_same_bits(got.dk, narrow<bfloat16>(want.dk, "dk"), "dk");
    expect_same_bits(got.dv, narrow<bfloat16>(want.dv, "dv"), "dv");
    ASSERT_EQ(got.params.size(), want.params.size());
    for (size_t i = 0; i < got.params.size(); ++i)
      expect_same_bits(got.params[i].second, narrow<bfloat16>(want.params[i].second, "param"), "param");
  };
  for (const Bf16ProductCase c : {Bf16ProductCase{"linear", "elu"}, Bf16ProductCase{"favor", "trig"},
                                  Bf16ProductCase{"favor", "positive"}}) {
    SCOPED_TRACE(::testing::Message() << c.method << " " << c.map);
    const MethodInfo& m = method(c.method);
    const KernelizedSpec s = spec_for(c.map, Mask::None, 1, 9);
    const MethodArgs<bfloat16> large_v = bf16_args(c.method, s, q, k, big_v, &w), in_range = bf16_args(c.method, s, q, k, v, &w);
    // With float32 products the registry widens (the kernels give nothing); with bfloat16
    // products the kernels widen themselves, to keep those products.
    const bool own = registry_products(c.map) == Products::Bfloat16;
    EXPECT_EQ(m.bf16_kernel(large_v).has_value(), own);
    EXPECT_EQ(m.bf16_backward_kernel(large_v, dout, {}).has_value(), own);
    EXPECT_TRUE(m.bf16_kernel(in_range).has_value());
    EXPECT_EQ(m.bf16_backward_kernel(in_range, big_dout, {}).has_value(), own);
    expect_widened(c.method, c.map, large_v, dout);
    expect_widened(c.method, c.map, in_range, big_dout);
  }
  MethodArgs<bfloat16> conv = bf16_args("linear", spec_for("elu", Mask::None, 1, 9), q, k, v, nullptr);
  const Tensor<bfloat16> dwc = bf16(random_tensor<double>({2, 3}, 6));
  conv.tensors["conv_weight"] = dwc;
  const bool own = registry_products("elu") == Products::Bfloat16;
  EXPECT_EQ(method("linear").bf16_kernel(conv).has_value(), own);
  EXPECT_EQ(method("linear").bf16_backward_kernel(conv, dout, {}).has_value(), own);
  expect_widened("linear", "elu", conv, dout);
}

// A FAVOR map whose projection is packed once (pack_projection, as bfloat16 calls make it) gives
// the bits of packing ω per product: logits and logits_backward, keys and queries, positive and
// hyperbolic, m != d and m == d (where a wrong transpose would still fit the shapes), rows across
// the 32-row packing blocks.
TEST(KernelizedBf16Products, PackedProjectionGivesTheSameBits) {
  if (!bfloat16_products_usable()) GTEST_SKIP() << "no AVX512-BF16 here";
  for (const char* kernel : {"positive", "hyperbolic"})
    for (const auto [m, d] : {std::array<int64_t, 2>{24, 16}, {16, 16}, {40, 7}}) {
      SCOPED_TRACE(::testing::Message() << kernel << " m=" << m << " d=" << d);
      const Tensor<float> w = cast<float>(random_features<double>(m, d, FeatureKind::Orthogonal, 7));
      const FeatureMap<float> plain = FeatureMap<float>::favor("test", parse_favor_kernel("test", kernel), w.view(), d,
                                                               std::nullopt);
      FeatureMap<float> packed = plain;
      packed.pack_projection();
      ASSERT_TRUE(packed.projection_packed());
      ASSERT_FALSE(plain.projection_packed());
      const int64_t n = 37, mm = plain.dim();
      const Tensor<float> x = cast<float>(random_tensor<double>({n, d}, 3)), dL = cast<float>(random_tensor<double>({n, mm}, 4));
      for (const Side side : {Side::Key, Side::Query}) {
        std::vector<float> L0(n * mm), L1(n * mm), dx0(n * d), dx1(n * d), scratch(plain.scratch_size(n));
        plain.logits("test", x.data(), n, side, L0.data(), nullptr, Products::Bfloat16);
        packed.logits("test", x.data(), n, side, L1.data(), nullptr, Products::Bfloat16);
        plain.logits_backward(x.data(), n, side, dL.data(), nullptr, nullptr, dx0.data(), scratch.data(), Products::Bfloat16);
        packed.logits_backward(x.data(), n, side, dL.data(), nullptr, nullptr, dx1.data(), scratch.data(), Products::Bfloat16);
        for (size_t i = 0; i < L0.size(); ++i) ASSERT_EQ(std::bit_cast<uint32_t>(L0[i]), std::bit_cast<uint32_t>(L1[i])) << i;
        for (size_t i = 0; i < dx0.size(); ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(dx0[i]), std::bit_cast<uint32_t>(dx1[i])) << i;
      }
    }
}

// bfloat16 products for FAVOR's trig kernel are refused, on the widened path and on the storage
// path alike (its signed features would let the operands' rounding outgrow the denominator).
TEST(KernelizedBf16, TrigRefusesBfloat16Products) {
  if (!bfloat16_products_usable()) GTEST_SKIP() << "no AVX512-BF16 here";
  const Tensor<double> x = random_tensor<double>({1, 2, 9, 4}, 1), w = random_features<double>(8, 4, FeatureKind::Orthogonal, 5);
  const Tensor<float> x32 = cast<float>(x), w32 = cast<float>(w);
  const Tensor<bfloat16> xb = testing::narrowed<bfloat16>(x);
  FavorOptions o;
  o.kernel = "trig";
  const char* want = "favor_attention: bfloat16 products are not for the trig kernel (its features are signed)";
  EXPECT_THAT(error_of([&] { kernelized::favor_forward(Products::Bfloat16, x32, x32, x32, w32, o); }), HasSubstr(want));
  EXPECT_THAT(error_of([&] { kernelized::favor_forward_bf16(Products::Bfloat16, xb, xb, xb, w32, o); }), HasSubstr(want));
}

// Bad bfloat16 input to the storage path: an error naming the argument, as for float32.
TEST(KernelizedBf16, BadInputIsAnErrorNamingIt) {
  const KernelizedSpec spec = spec_for("elu", Mask::None, 1, 9);
  auto bf16 = [](const Tensor<double>& x) { return testing::narrowed<bfloat16>(x); };
  const Tensor<bfloat16> q = bf16(random_tensor<double>({1, 2, 9, 4}, 1)), k = bf16(random_tensor<double>({1, 2, 9, 4}, 2)),
                         v = bf16(random_tensor<double>({1, 2, 9, 3}, 3)), dout = bf16(random_tensor<double>({1, 2, 9, 3}, 4));
  const MethodInfo& m = method("linear");
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    Tensor<bfloat16> k_bad = bf16(random_tensor<double>({1, 2, 9, 4}, 2)), dout_bad = bf16(random_tensor<double>({1, 2, 9, 3}, 4));
    k_bad[7] = to_bfloat16(bad), dout_bad[2] = to_bfloat16(bad);
    EXPECT_THAT(error_of([&] { m.bf16_kernel(bf16_args("linear", spec, q, k_bad, v, nullptr)); }),
                HasSubstr("linear_attention: k has a non-finite value"));
    EXPECT_THAT(error_of([&] { m.bf16_backward_kernel(bf16_args("linear", spec, q, k, v, nullptr), dout_bad, {}); }),
                HasSubstr("linear_attention_backward: dout has a non-finite value"));
  }
  KernelizedSpec given = spec;
  given.map = "given";
  Tensor<bfloat16> negative = bf16(given_features("given", random_tensor<double>({1, 2, 9, 4}, 1)));
  const Tensor<bfloat16> features = bf16(given_features("given", random_tensor<double>({1, 2, 9, 4}, 2)));
  negative[3] = to_bfloat16(-0.5f);
  EXPECT_THAT(error_of([&] { m.bf16_kernel(bf16_args("linear", given, negative, features, v, nullptr)); }),
              HasSubstr("q holds features, which must be >= 0; got -0.5 at row 0 (counting over batch·heads·seq), feature 3"));
  const Tensor<bfloat16> short_v = bf16(random_tensor<double>({1, 2, 8, 3}, 3));
  EXPECT_THAT(error_of([&] { m.bf16_kernel(bf16_args("linear", spec, q, k, short_v, nullptr)); }),
              HasSubstr("linear_attention: v has shape [1, 2, 8, 3]; expected [1, 2, 9, value_dim]"));
}

// Non-causal with n_q != n_k; the keys cross the block of the key passes.
TEST(KernelizedVsReference, DifferentQueryAndKeyLengths) {
  constexpr int64_t nk = kernelized::kBlockRows + 76;  // 1100
  for (const char* map : {"elu", "focused", "positive", "trig"}) {
    SCOPED_TRACE(map);
    const KernelizedSpec spec = spec_for(map, Mask::KeyLengths, 3, nk);
    const auto q = random_tensor<double>({3, 2, 50, 16}, 1), k = random_tensor<double>({3, 2, nk, 16}, 2),
               v = random_tensor<double>({3, 2, nk, 12}, 3), dout = random_tensor<double>({3, 2, 50, 12}, 4);
    const auto w = random_features<double>(40, 16, FeatureKind::IID, 5);
    const auto exact = testing::kernelized_exact_with_bounds<double>(q, k, v, dout, &w, spec);
    expect_within(run_forward<double>(spec, q, k, v, &w), exact.out, exact.out_bound, "out");
    const auto g = run_backward<double>(spec, q, k, v, dout, &w);
    expect_within(g.dq, exact.dq, exact.dq_bound, "dq");
    expect_within(g.dk, exact.dk, exact.dk_bound, "dk");
  }
}

TEST(KernelizedGradient, MatchesCentralDifferences) {
  for (const char* map : {"elu", "relu", "given", "focused", "positive", "hyperbolic", "trig"})
    for (Mask mask : {Mask::None, Mask::CausalKeyLengths}) {
      SCOPED_TRACE(::testing::Message() << map << " mask=" << int(mask));
      const int64_t B = 2, H = 2, n = 70, d = 4, dv = 3;  // 70 rows: two causal chunks
      KernelizedSpec spec = spec_for(map, mask, B, n);
      spec.key_lengths = std::vector<int64_t>{n, 45};
      const double sigma = std::string(map) == "trig" ? 0.5 : 1.0;
      auto q = random_tensor<double>({B, H, n, d}, 1, sigma), k = random_tensor<double>({B, H, n, d}, 2, sigma),
           v = random_tensor<double>({B, H, n, dv}, 3);
      // relu and focused are not smooth at 0: keep inputs 0.05 (5000 h) away from the kink so
      // the truncation term (h²/6 times the third derivative) is that of a smooth function.
      for (Tensor<double>* x : {&q, &k}) {
        *x = given_features(map, std::move(*x));
        for (int64_t i = 0; i < x->size(); ++i)
          if (std::abs((*x)[i]) < 0.05) (*x)[i] = (*x)[i] < 0 ? -0.05 : 0.05;
      }
      const auto G = random_tensor<double>({B, H, n, dv}, 4);
      // 64 features keep the trig estimate of the denominator well away from 0.
      const auto w = random_features<double>(64, d, FeatureKind::Orthogonal, 5);
      auto loss = [&] {
        const auto out = run_forward<double>(spec, q, k, v, &w);
        double L = 0;
        for (int64_t i = 0; i < out.size(); ++i) L += out[i] * G[i];
        return L;
      };
      const auto g = run_backward<double>(spec, q, k, v, G, &w);
      expect_gradient(q, g.dq, loss, "dq");
      expect_gradient(k, g.dk, loss, "dk");
      expect_gradient(v, g.dv, loss, "dv");
    }
}

// The depthwise convolution on V and its weight gradient, centred and causal.
TEST(KernelizedGradient, DepthwiseConvolution) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "centred");
    const int64_t B = 2, H = 3, n = 20, d = 4, dv = 3, K = causal ? 4 : 5;
    auto q = random_tensor<double>({B, H, n, d}, 1), k = random_tensor<double>({B, H, n, d}, 2),
         v = random_tensor<double>({B, H, n, dv}, 3), w = random_tensor<double>({H, K}, 4);
    const auto G = random_tensor<double>({B, H, n, dv}, 5);
    LinearAttentionOptions o;
    o.feature_map = "focused";
    o.causal = causal;
    o.key_lengths = std::vector<int64_t>{n, 13};
    // Against the reference, in float64: every term is a short sum, errors ~1e-15.
    const auto out = linear_attention<double>(q, k, v, o, w.view());
    const auto ref = reference::linear_attention(q, k, v, o, w.view());
    for (int64_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-12);
    auto loss = [&] {
      const auto y = linear_attention<double>(q, k, v, o, w.view());
      double L = 0;
      for (int64_t i = 0; i < y.size(); ++i) L += y[i] * G[i];
      return L;
    };
    const auto g = linear_attention_backward<double>(q, k, v, G, o, w.view());
    ASSERT_EQ(g.param("conv_weight").shape(), (Shape{H, K}));
    expect_gradient(w, g.param("conv_weight"), loss, "d_conv_weight");
    expect_gradient(v, g.dv, loss, "dv");
    expect_gradient(q, g.dq, loss, "dq");
    const auto gr = reference::linear_attention_backward(q, k, v, G, o, w.view());
    for (int64_t i = 0; i < g.param("conv_weight").size(); ++i)
      ASSERT_NEAR(g.param("conv_weight")[i], gr.param("conv_weight")[i], 1e-12);
    // Padded positions of v (>= 13 in item 1) never reach the output.
    auto v2 = cast<double>(v);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 13; j < n; ++j)
        for (int64_t c = 0; c < dv; ++c) v2.view().row(H + h, j)[c] = 1e3;
    const auto out2 = linear_attention<double>(q, k, v2, o, w.view());
    for (int64_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], out2[i]);
  }
}

// FAVOR with row norms of q and k of 30 to 100 at d = 64 in float32: exp(ω·x̃ − ‖x̃‖²/2)
// spans far more than float32's exponent range across features and keys (‖x̃‖²/2 ≈ 56 at norm
// 30, 625 at 100), and a query's largest features can be ones no key shares. The per-feature
// shifts of the engine must still give the float64 definition within the derived bound, causal
// or not, every output and gradient finite.
TEST(KernelizedLargeNorms, FavorStaysAccurateAtNorms30To100) {
  const int64_t B = 1, H = 2, n = 200, d = 64, dv = 16;
  const auto w = random_features<float>(128, d, FeatureKind::Orthogonal, 7);
  const auto wd = cast<double>(w);
  for (double norm : {30.0, 45.0, 60.0}) {
    auto q = random_tensor<double>({B, H, n, d}, 1), k = random_tensor<double>({B, H, n, d}, 2);
    for (Tensor<double>* x : {&q, &k})  // every row of norm `norm`
      for (int64_t i = 0; i < B * H * n; ++i) {
        double s = 0;
        for (int64_t c = 0; c < d; ++c) s += (*x)[i * d + c] * (*x)[i * d + c];
        for (int64_t c = 0; c < d; ++c) (*x)[i * d + c] *= norm / std::sqrt(s);
      }
    const auto v = random_tensor<double>({B, H, n, dv}, 3), dout = random_tensor<double>({B, H, n, dv}, 4);
    for (const char* kernel : {"positive", "hyperbolic"})
      for (bool causal : {true, false}) {
        SCOPED_TRACE(::testing::Message() << kernel << (causal ? " causal" : "") << " norm " << norm);
        KernelizedSpec spec;
        spec.map = kernel;
        spec.causal = causal;
        const auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v), gf = cast<float>(dout);
        const auto exact = testing::kernelized_exact_with_bounds<float>(
            cast<double>(qf), cast<double>(kf), cast<double>(vf), cast<double>(gf), &wd, spec);
        const auto out = run_forward<float>(spec, qf, kf, vf, &w);
        for (int64_t i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out[i])) << i;
        expect_within(out, exact.out, exact.out_bound, "out");
        const auto g = run_backward<float>(spec, qf, kf, vf, gf, &w);
        expect_within(g.dq, exact.dq, exact.dq_bound, "dq");
        expect_within(g.dk, exact.dk, exact.dk_bound, "dk");
        expect_within(g.dv, exact.dv, exact.dv_bound, "dv");
      }
  }
}

// At norm 100 the float64 reference itself underflows (exp(ω·x̃ − ‖x̃‖²/2) down to e^−900),
// so float32 is checked against the float64 fast path. Each float32 logit carries an error of
// at most δ = γ_{d+1}·√s·Σ_c|x_c ω_rc| + u|U| (U = ω·x̃), plus γ_{d+3}·h for the key's h, plus
// u·(|L| + |shift|) for the shifted exponent and u for exp. A weight a_ij = Σ_r exp(gq_ir + gk_jr)
// is then off by a factor within e^{±E}, E the largest such sum over a query and a key row,
// and an output, a weighted mean of the v_j, by at most (e^{2E} − 1)·max_j |v_j|. Gradients:
// finite (their bound needs the reference's magnitudes).
TEST(KernelizedLargeNorms, FavorFloat32MatchesFloat64AtNorm100) {
  const int64_t B = 1, H = 2, n = 300, d = 64, dv = 16;
  const double norm = 100, u = testing::unit_roundoff<float>(), s = 1 / std::sqrt(double(d));
  const auto w = random_features<float>(128, d, FeatureKind::Orthogonal, 7);
  auto q = random_tensor<double>({B, H, n, d}, 1), k = random_tensor<double>({B, H, n, d}, 2);
  for (Tensor<double>* x : {&q, &k})
    for (int64_t i = 0; i < B * H * n; ++i) {
      double sum = 0;
      for (int64_t c = 0; c < d; ++c) sum += (*x)[i * d + c] * (*x)[i * d + c];
      for (int64_t c = 0; c < d; ++c) (*x)[i * d + c] = static_cast<float>((*x)[i * d + c] * norm / std::sqrt(sum));
    }
  const auto v = random_tensor<double>({B, H, n, dv}, 3), dout = random_tensor<double>({B, H, n, dv}, 4);
  // E: the largest logit error of a query row plus that of a key row.
  auto row_error = [&](const Tensor<double>& x, bool key) {
    double worst = 0;
    for (int64_t i = 0; i < B * H * n; ++i) {
      const double* xr = x.data() + i * d;
      double h = 0;
      for (int64_t c = 0; c < d; ++c) h += 0.5 * s * xr[c] * xr[c];
      for (int64_t r = 0; r < w.dim(0); ++r) {
        double U = 0, absU = 0;
        for (int64_t c = 0; c < d; ++c) {
          U += std::sqrt(s) * xr[c] * w[r * d + c];
          absU += std::sqrt(s) * std::abs(xr[c] * w[r * d + c]);
        }
        const double L = std::abs(U) + (key ? h : 0);
        worst = std::max(worst, testing::gamma<float>(d + 1) * absU + u * std::abs(U) +
                                    (key ? testing::gamma<float>(d + 3) * h : 0) + u * 3 * L + u);
      }
    }
    return worst;
  };
  const double E = row_error(q, false) + row_error(k, true);
  double vmax = 0;
  for (int64_t i = 0; i < v.size(); ++i) vmax = std::max(vmax, std::abs(v[i]));
  const double bound = std::expm1(2 * E) * vmax;
  for (const char* kernel : {"positive", "hyperbolic"})
    for (bool causal : {true, false}) {
      SCOPED_TRACE(::testing::Message() << kernel << (causal ? " causal" : "") << " E = " << E);
      KernelizedSpec spec;
      spec.map = kernel;
      spec.causal = causal;
      const auto wd = cast<double>(w);
      const auto out64 = run_forward<double>(spec, q, k, v, &wd);
      const auto out = run_forward<float>(spec, cast<float>(q), cast<float>(k), cast<float>(v), &w);
      for (int64_t i = 0; i < out.size(); ++i) {
        ASSERT_TRUE(std::isfinite(out[i])) << i;
        ASSERT_LE(std::abs(out[i] - out64[i]), bound) << i;
      }
      const auto g = run_backward<float>(spec, cast<float>(q), cast<float>(k), cast<float>(v), cast<float>(dout), &w);
      for (const Tensor<float>* t : {&g.dq, &g.dk, &g.dv})
        for (int64_t i = 0; i < t->size(); ++i) ASSERT_TRUE(std::isfinite((*t)[i])) << i;
    }
}

// The focused map with a large power and large inputs: rᵖ would overflow float32 (10^50) and
// lose digits to p if r were rounded first; computed on r/2^e in a wider type, it matches the
// float64 definition within the same derived bound as at p = 3, forward and gradients.
TEST(KernelizedFocusedPower, LargePowerAndLargeInputs) {
  const int64_t B = 1, H = 2, n = 70, d = 16;
  const auto q = random_tensor<double>({B, H, n, d}, 1, 10.0), k = random_tensor<double>({B, H, n, d}, 2, 10.0);
  const auto v = random_tensor<double>({B, H, n, d}, 3), dout = random_tensor<double>({B, H, n, d}, 4);
  for (double power : {12.0, 50.0})
    for (bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "p = " << power << (causal ? " causal" : ""));
      KernelizedSpec spec;
      spec.map = "focused";
      spec.focus_power = power;
      spec.causal = causal;
      const auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v), gf = cast<float>(dout);
      const auto exact = testing::kernelized_exact_with_bounds<float>(
          cast<double>(qf), cast<double>(kf), cast<double>(vf), cast<double>(gf), nullptr, spec);
      expect_within(run_forward<float>(spec, qf, kf, vf, nullptr), exact.out, exact.out_bound, "out");
      const auto g = run_backward<float>(spec, qf, kf, vf, gf, nullptr);
      expect_within(g.dq, exact.dq, exact.dq_bound, "dq");
      expect_within(g.dk, exact.dk, exact.dk_bound, "dk");
      expect_within(g.dv, exact.dv, exact.dv_bound, "dv");
    }
}

// The causal backward keeps its chunks' features between its passes as far as the cache
// allows and computes the rest again, with bitwise the same result: all cached (default), a
// few chunks' worth, none. FAVOR with a padded item (its chunks end early) and elu.
TEST(KernelizedBackward, FeatureCacheDoesNotChangeResults) {
  const auto q = random_tensor<float>({2, 2, 1100, 16}, 1), k = random_tensor<float>({2, 2, 1100, 16}, 2),
             v = random_tensor<float>({2, 2, 1100, 8}, 3), g = random_tensor<float>({2, 2, 1100, 8}, 4);
  const auto w = random_features<float>(32, 16);
  FavorOptions fo;
  fo.causal = true;
  fo.key_lengths = std::vector<int64_t>{1100, 700};
  LinearAttentionOptions lo;
  lo.causal = true;
  const auto favor = favor_attention_with_saved<float>(q, k, v, w, fo);
  const auto linear = linear_attention_with_saved<float>(q, k, v, lo);
  const int64_t budget = kernelized::feature_cache_bytes();
  const auto favor_all = favor_attention_backward<float>(q, k, v, w, g, favor.out, favor.den, favor.state, fo);
  const auto linear_all = linear_attention_backward<float>(q, k, v, g, linear.out, linear.den, linear.state, lo);
  for (int64_t bytes : {int64_t{5} * kernelized::kChunk * 4 * 32 * 4, int64_t{0}}) {
    SCOPED_TRACE(::testing::Message() << "cache bytes " << bytes);
    kernelized::set_feature_cache_bytes(bytes);
    for (int threads : {1, 3}) {
      ScopedThreads scope(threads);
      const auto f = favor_attention_backward<float>(q, k, v, w, g, favor.out, favor.den, favor.state, fo);
      const auto l = linear_attention_backward<float>(q, k, v, g, linear.out, linear.den, linear.state, lo);
      testing::expect_identical(f.dq, favor_all.dq, "favor dq");
      testing::expect_identical(f.dk, favor_all.dk, "favor dk");
      testing::expect_identical(f.dv, favor_all.dv, "favor dv");
      testing::expect_identical(l.dq, linear_all.dq, "elu dq");
      testing::expect_identical(l.dk, linear_all.dk, "elu dk");
      testing::expect_identical(l.dv, linear_all.dv, "elu dv");
    }
  }
  kernelized::set_feature_cache_bytes(budget);
}

// The saved tensors are checked: shapes from the same call, finite values (state's shifts may
// be −inf), and the registry takes out, den and state together or not at all.
TEST(KernelizedBackward, SavedTensorsAreChecked) {
  const auto q = random_tensor<float>({1, 2, 9, 8}, 1), k = random_tensor<float>({1, 2, 9, 8}, 2),
             v = random_tensor<float>({1, 2, 9, 4}, 3), g = random_tensor<float>({1, 2, 9, 4}, 4);
  const auto w = random_features<float>(16, 8);
  const auto f = favor_attention_with_saved<float>(q, k, v, w);
  EXPECT_EQ(f.den.shape(), (Shape{1, 2, 9}));
  EXPECT_EQ(f.state.shape(), (Shape{1, 2, 16, 6}));
  const auto backward = [&](const Tensor<float>& out, const Tensor<float>& den, const Tensor<float>& state) {
    return error_of([&] { favor_attention_backward<float>(q, k, v, w, g, out, den, state); });
  };
  EXPECT_THAT(backward(f.out, f.den, random_tensor<float>({1, 2, 8, 6}, 5)),
              HasSubstr("favor_attention_backward: state has shape [1, 2, 8, 6]; expected [1, 2, 16, 6]"));
  EXPECT_THAT(backward(f.out, random_tensor<float>({1, 2, 8}, 5), f.state),
              HasSubstr("favor_attention_backward: den has shape [1, 2, 8]; expected [1, 2, 9]"));
  EXPECT_THAT(backward(random_tensor<float>({1, 2, 9, 5}, 5), f.den, f.state),
              HasSubstr("favor_attention_backward: out has shape"));
  Tensor<float> den = cast<float>(f.den), state = cast<float>(f.state);
  den[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(backward(f.out, den, f.state), HasSubstr("den"));
  state[3] = -std::numeric_limits<float>::infinity();  // an S entry, not a shift
  EXPECT_THAT(backward(f.out, f.den, state), HasSubstr("state[3] = -inf; expected a finite value"));
  // No key at all: every shift is −inf, and the backward from that state gives zero gradients.
  FavorOptions empty;
  empty.key_lengths = std::vector<int64_t>{0};
  const auto e = favor_attention_with_saved<float>(q, k, v, w, empty);
  for (int64_t r = 0; r < 2 * 16; ++r) ASSERT_EQ(e.state[r * 6 + 5], -std::numeric_limits<float>::infinity()) << r;
  const auto ge = favor_attention_backward<float>(q, k, v, w, g, e.out, e.den, e.state, empty);
  for (int64_t i = 0; i < ge.dq.size(); ++i) ASSERT_EQ(ge.dq[i], 0.f) << i;
  for (int64_t i = 0; i < ge.dk.size(); ++i) ASSERT_EQ(ge.dk[i], 0.f) << i;
  MethodArgs<float> a{q, k, v, {}, {{"projection", w.view()}}};
  const std::map<std::string, TensorView<const float>, std::less<>> partial{{"out", f.out.view()},
                                                                            {"den", f.den.view()}};
  EXPECT_THAT(error_of([&] { method("favor").f32.backward(a, g, partial); }),
              HasSubstr("favor_attention_backward: pass out, den and state (from the forward), or none of them"));
}

// The engine checks the gradients while it writes them (no second pass over dq, dk, dv when
// nothing was rescaled): a saved den far too small makes dout/den overflow float32, and that is
// an Error naming the gradient, causal and not, on 1, 2, 5 and 16 threads (batch·heads = 3);
// with den as saved the same calls are finite.
TEST(KernelizedBackward, GradientOverflowFoundInTheKernelIsAnError) {
  const auto q = random_tensor<float>({1, 3, 40, 8}, 1), k = random_tensor<float>({1, 3, 40, 8}, 2),
             v = random_tensor<float>({1, 3, 40, 4}, 3), g = random_tensor<float>({1, 3, 40, 4}, 4);
  for (const bool causal : {false, true})
    for (const int threads : {1, 2, 5, 16}) {
      testing::ScopedThreads scope(threads);
      LinearAttentionOptions o;
      o.causal = causal;
      const auto f = linear_attention_with_saved<float>(q, k, v, o);
      const auto ok = linear_attention_backward<float>(q, k, v, g, f.out, f.den, f.state, o);
      for (const Tensor<float>* t : {&ok.dq, &ok.dk, &ok.dv})
        for (int64_t i = 0; i < t->size(); ++i) ASSERT_TRUE(std::isfinite((*t)[i])) << i;
      Tensor<float> den = cast<float>(f.den);
      den[2 * 40 + 17] = 1e-38f;  // head 2, row 17: dnum = dout / 1e-38 overflows
      EXPECT_THAT(error_of([&] { linear_attention_backward<float>(q, k, v, g, f.out, den, f.state, o); }),
                  HasSubstr("overflows float32"))
          << "causal " << causal << ", " << threads << " threads";
    }
}

// Padded keys may hold anything, NaN included.
TEST(KernelizedMask, PaddedKeysAreIgnored) {
  auto q = random_tensor<float>({2, 2, 100, 8}, 1), k = random_tensor<float>({2, 2, 100, 8}, 2),
       v = random_tensor<float>({2, 2, 100, 8}, 3);
  const auto w = random_features<float>(16, 8, FeatureKind::Orthogonal, 1);
  FavorOptions o;
  o.causal = true;
  o.key_lengths = std::vector<int64_t>{100, 61};
  const auto clean = favor_attention<float>(q, k, v, w, o);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t j = 61; j < 100; ++j)
      for (int64_t c = 0; c < 8; ++c) {
        k.view().row(2 + h, j)[c] = std::numeric_limits<float>::quiet_NaN();
        v.view().row(2 + h, j)[c] = std::numeric_limits<float>::infinity();
      }
  const auto dirty = favor_attention<float>(q, k, v, w, o);
  for (int64_t i = 0; i < clean.size(); ++i) ASSERT_EQ(clean[i], dirty[i]);
}

// feature_map "given" was "identity" until 0.2 (issue 43): the old name still computes the same,
// bit for bit, in every function that took it (and in the reference), for one release; the
// registry names it, so the Python layers accept it with a DeprecationWarning.
TEST(Kernelized, FormerNameOfGivenFeaturesComputesTheSame) {
  const auto fq = given_features("given", random_tensor<double>({1, 2, 7, 4}, 31));
  const auto fk = given_features("given", random_tensor<double>({1, 2, 7, 4}, 32));
  const auto v = random_tensor<double>({1, 2, 7, 3}, 33);
  LinearAttentionOptions now, before;
  now.feature_map = "given";
  before.feature_map = kFormerGivenName;
  now.causal = before.causal = true;
  testing::expect_same_bits("linear_attention", linear_attention<double>(fq, fk, v, before), linear_attention<double>(fq, fk, v, now));
  testing::expect_same_bits("reference", reference::linear_attention(fq, fk, v, before), reference::linear_attention(fq, fk, v, now));
  RecurrentOptions rnow, rbefore;
  rnow.feature_map = "given";
  rbefore.feature_map = kFormerGivenName;
  testing::expect_same_bits("features", features<double>(fk, rbefore), features<double>(fk, rnow));
  RecurrentState<double> a(1, 2, 4, 3, rbefore), b(1, 2, 4, 3, rnow);
  testing::expect_same_bits("prefill", a.prefill(fq, fk, v), b.prefill(fq, fk, v));
  const auto& options = method("linear").options;
  const auto option = std::find_if(options.begin(), options.end(), [](const OptionInfo& o) { return o.name == "feature_map"; });
  ASSERT_NE(option, options.end());
  EXPECT_THAT(option->choices, ::testing::Contains("given"));
  EXPECT_THAT(option->choices, ::testing::Not(::testing::Contains(kFormerGivenName)));
  EXPECT_EQ(option->former_choices, (std::vector<std::pair<std::string, std::string>>{{"identity", "given"}}));
}

// ---- bad input -----------------------------------------------------------------------------

TEST(KernelizedErrors, OptionsAndShapesAreChecked) {
  const auto q = random_tensor<float>({1, 2, 5, 8}, 1), k = random_tensor<float>({1, 2, 6, 8}, 2),
             v = random_tensor<float>({1, 2, 6, 4}, 3);
  LinearAttentionOptions o;
  o.feature_map = "softplus";
  EXPECT_THAT(error_of([&] { linear_attention<float>(q, k, v, o); }),
              HasSubstr("feature_map must be \"elu\", \"relu\", \"focused\" or \"given\"; got \"softplus\""));
  o = {};
  o.causal = true;
  EXPECT_THAT(error_of([&] { linear_attention<float>(q, k, v, o); }),
              HasSubstr("causal=true needs n_q == n_k (got n_q = 5, n_k = 6)"));
  o = {};
  o.eps = -1;
  EXPECT_THAT(error_of([&] { linear_attention<float>(q, k, v, o); }), HasSubstr("eps must be finite and >= 0"));
  o = {};
  o.feature_map = "focused";
  o.focus_power = 0.5;
  EXPECT_THAT(error_of([&] { linear_attention<float>(q, k, v, o); }), HasSubstr("focus_power must be a number in [1, 1000], got 0.5"));
  o.focus_power = 1001;
  EXPECT_THAT(error_of([&] { linear_attention<float>(q, k, v, o); }), HasSubstr("focus_power must be a number in [1, 1000], got 1001"));
  // Given features must be >= 0; the message names the argument and the position.
  o = {};
  o.feature_map = "given";
  const auto fq = given_features("given", random_tensor<double>({1, 2, 6, 8}, 4));
  auto fk = cast<double>(fq);  // a copy
  fk[2 * 8 + 3] = -0.5;  // row 2, feature 3
  EXPECT_THAT(error_of([&] { linear_attention<double>(fq, fk, cast<double>(v), o); }),
              HasSubstr("with feature_map=\"given\", k holds features, which must be >= 0; got -0.5 at row 2 "
                        "(counting over batch·heads·seq), feature 3"));
  EXPECT_THAT(error_of([&] { linear_attention<double>(fk, fq, cast<double>(v), o); }),
              HasSubstr("q holds features, which must be >= 0"));
  RecurrentOptions ro;
  ro.feature_map = "given";
  RecurrentState<double> state(1, 2, 8, 4, ro);
  EXPECT_THAT(error_of([&] { state.prefill(fq, fk, cast<double>(v)); }), HasSubstr("k holds features, which must be >= 0"));
  EXPECT_EQ(state.tokens(), 0);
  const auto qq = random_tensor<float>({1, 2, 6, 8}, 1);
  o = {};
  EXPECT_THAT(error_of([&] { linear_attention<float>(qq, k, v, o, random_tensor<float>({2, 4}, 1).view()); }),
              HasSubstr("conv_weight needs an odd K when causal=false (got K = 4)"));
  EXPECT_THAT(error_of([&] { linear_attention<float>(qq, k, v, o, random_tensor<float>({3, 5}, 1).view()); }),
              HasSubstr("conv_weight has shape [3, 5]; expected [heads = 2, K]"));
  const auto w = random_features<float>(16, 8);
  FavorOptions f;
  f.kernel = "cosh";
  EXPECT_THAT(error_of([&] { favor_attention<float>(q, k, v, w, f); }),
              HasSubstr("kernel must be \"positive\", \"hyperbolic\" or \"trig\"; got \"cosh\""));
  f = {};
  EXPECT_THAT(error_of([&] { favor_attention<float>(q, k, v, random_features<float>(16, 7)); }),
              HasSubstr("projection has shape [16, 7]; expected [num_features >= 1, 8]"));
  f.scale = -1;
  EXPECT_THAT(error_of([&] { favor_attention<float>(q, k, v, w, f); }), HasSubstr("scale must be > 0"));
  auto bad = random_tensor<float>({1, 2, 6, 4}, 3);
  bad[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(error_of([&] { favor_attention<float>(q, k, bad, w); }), HasSubstr("v has a non-finite value"));
  EXPECT_THAT(error_of([&] { favor_attention_backward<float>(q, k, v, w, random_tensor<float>({1, 2, 5, 5}, 1)); }),
              HasSubstr("dout has shape [1, 2, 5, 5]; expected [1, 2, 5, 4]"));
}

// A row that sees no key (key_lengths 0) gets zeros, never NaN, for every map.
TEST(KernelizedMask, EmptyRowsAreZero) {
  const auto q = random_tensor<float>({2, 1, 9, 4}, 1), k = random_tensor<float>({2, 1, 9, 4}, 2),
             v = random_tensor<float>({2, 1, 9, 4}, 3);
  const auto w = random_features<float>(8, 4);
  for (bool causal : {false, true}) {
    FavorOptions f;
    f.causal = causal;
    f.key_lengths = std::vector<int64_t>{9, 0};
    LinearAttentionOptions l;
    l.causal = causal;
    l.key_lengths = f.key_lengths;
    const auto a = favor_attention<float>(q, k, v, w, f);
    const auto b = linear_attention<float>(q, k, v, l);
    for (int64_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(std::isfinite(a[i]) && std::isfinite(b[i]));
      if (i >= a.size() / 2) {
        ASSERT_EQ(a[i], 0.f);
        ASSERT_EQ(b[i], 0.f);
      }
    }
  }
}

}  // namespace
}  // namespace linattn
