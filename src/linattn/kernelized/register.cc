// linear_attention and favor_attention in the method registry.
#include <string>

#include "linattn/core/method_support.h"
#include "linattn/kernelized.h"
#include "linattn/kernelized/args.h"
#include "linattn/core/feature_map.h"
#include "linattn/kernelized/engine.h"
#include "linattn/kernelized/products_calls.h"
#include "linattn/random_features.h"

namespace linattn {
namespace {

using namespace registry_support;
using kernelized::SavedResults;

// The forward's output with its saved den and state, as a registry output (Result:
// KernelizedAttentionResult<T>, or a bfloat16 call's kernelized::Bf16Forward).
template <class T, class Result>
MethodOutput<T> with_saved(Result r) {
  MethodOutput<T> out{std::move(r.out), {}};
  out.saved.emplace_back("den", std::move(r.den));
  out.saved.emplace_back("state", std::move(r.state));
  return out;
}

template <class T>
MethodOutput<T> linear_forward(const MethodArgs<T>& a) {
  const auto c = kernelized::linear_call(a);
  return with_saved<T>(linear_attention_with_saved<T>(a.q, a.k, a.v, c.opts, c.conv_weight));
}

template <class T>
AttentionGrads<T> linear_backward(const MethodArgs<T>& a, TensorView<const T> dout,
                                  const std::map<std::string, TensorView<const T>, std::less<>>& saved) {
  const auto c = kernelized::linear_call(a);
  if (const auto s = saved_tensors<T, 3>("linear_attention_backward", saved, {"out", "den", "state"}))
    return linear_attention_backward<T>(a.q, a.k, a.v, dout, (*s)[0], (*s)[1], (*s)[2], c.opts, c.conv_weight);
  return linear_attention_backward<T>(a.q, a.k, a.v, dout, c.opts, c.conv_weight);
}

template <class T>
MethodOutput<T> favor_forward(const MethodArgs<T>& a) {
  const auto c = kernelized::favor_call(a);
  return with_saved<T>(favor_attention_with_saved<T>(a.q, a.k, a.v, c.projection, c.opts));
}

template <class T>
AttentionGrads<T> favor_backward(const MethodArgs<T>& a, TensorView<const T> dout,
                                 const std::map<std::string, TensorView<const T>, std::less<>>& saved) {
  const auto c = kernelized::favor_call(a);
  if (const auto s = saved_tensors<T, 3>("favor_attention_backward", saved, {"out", "den", "state"}))
    return favor_attention_backward<T>(a.q, a.k, a.v, c.projection, dout, (*s)[0], (*s)[1], (*s)[2], c.opts);
  return favor_attention_backward<T>(a.q, a.k, a.v, c.projection, dout, c.opts);
}

// ---- bfloat16 calls ----
// The float32 engine reading and writing bfloat16 a block at a time (products_calls.h): no
// widened copy of q, k, v, dout or the results. Where the CPU has AVX512-BF16, every matrix
// product takes its operands rounded to bfloat16 and sums in float32 (vdpbf16ps;
// docs/precision.md): linear_attention's maps and FAVOR's positive and hyperbolic kernels have
// non-negative features, so those roundings stay bounded by the denominator. FAVOR's trig
// kernel has signed features, whose rounding errors could outgrow it: float32 products. Where
// the storage path gives nothing (v or dout beyond 2^64, a conv_weight), the call widens whole
// and runs the float32 call with the same products.

// The widened calls' saved tensors (out widened here from saved.out_as_returned if it came so).
std::optional<SavedResults<float>> saved_results(const char* fn, const SavedViews<bfloat16>& saved, Tensor<float>& keep) {
  if (const auto s = saved_tensors<float, 3>(fn, with_float_out(fn, saved, keep), {"out", "den", "state"}))
    return SavedResults<float>{(*s)[0], (*s)[1], (*s)[2]};
  return std::nullopt;
}

// The storage calls': out as the forward returned it when it came so (read a block at a time,
// never widened whole), else as given.
std::optional<kernelized::Bf16SavedResults> bf16_saved_results(const char* fn, const SavedViews<bfloat16>& saved) {
  if (!has_out_as_returned(fn, saved)) {
    Tensor<float> unused;
    if (const auto s = saved_results(fn, saved, unused)) return kernelized::Bf16SavedResults{*s, std::nullopt};
    return std::nullopt;
  }
  // den and state, checked by saved_tensors as ever, with a stand-in for the out that came apart.
  SavedViews<bfloat16> views = saved;
  views.emplace("out", TensorView<const float>{});
  const auto s = saved_tensors<float, 3>(fn, views, {"out", "den", "state"});  // out is there: all, or an error
  return kernelized::Bf16SavedResults{SavedResults<float>{{}, (*s)[1], (*s)[2]}, saved.out_as_returned};
}

Products bf16_products_where_usable() {
  return bfloat16_products_usable() ? Products::Bfloat16 : Products::Native;
}

// A bfloat16 forward: the storage call's result, or else, with bfloat16 products, the widened
// float32 call (widened(args) with the same products), rounded; nullopt leaves the registry's
// own widened float32 call.
template <class Storage, class Widened>
std::optional<MethodOutput<bfloat16>> bf16_forward(const char* fn, const MethodArgs<bfloat16>& a, Products products,
                                                   Storage storage, Widened widened) {
  if (auto r = storage()) return with_saved<bfloat16>(std::move(*r));
  if (products == Products::Native) return std::nullopt;
  const WidenedArgs<bfloat16> w(a);
  MethodOutput<float> f = with_saved<float>(widened(w.args));
  return MethodOutput<bfloat16>{narrow<bfloat16>(f.out, (std::string(fn) + ": out").c_str()), std::move(f.saved)};
}

// The same for a backward: widened(args, dout) on the widened arguments.
template <class Storage, class Widened>
std::optional<AttentionGrads<bfloat16>> bf16_backward(const char* fn, const MethodArgs<bfloat16>& a,
                                                      TensorView<const bfloat16> dout, Products products,
                                                      Storage storage, Widened widened) {
  if (auto g = storage()) return g;
  if (products == Products::Native) return std::nullopt;
  WidenedArgs<bfloat16> w(a);
  const TensorView<const float> dout32 = w.keep(dout);
  return narrow_grads<bfloat16>(widened(w.args, dout32), fn);
}

std::optional<MethodOutput<bfloat16>> linear_forward_bf16(const MethodArgs<bfloat16>& a) {
  const auto c = kernelized::linear_call(a);
  const Products products = bf16_products_where_usable();
  return bf16_forward(
      "linear_attention", a, products,
      [&]() -> std::optional<kernelized::Bf16Forward> {
        if (c.conv_weight) return std::nullopt;
        return kernelized::linear_forward_bf16(products, a.q, a.k, a.v, c.opts);
      },
      [&](const MethodArgs<float>& w) {
        const auto c32 = kernelized::linear_call(w);
        return kernelized::linear_forward(products, w.q, w.k, w.v, c32.opts, c32.conv_weight);
      });
}

std::optional<AttentionGrads<bfloat16>> linear_backward_bf16(const MethodArgs<bfloat16>& a, TensorView<const bfloat16> dout,
                                                             const SavedViews<bfloat16>& saved) {
  const char* fn = "linear_attention_backward";
  const auto c = kernelized::linear_call(a);
  const Products products = bf16_products_where_usable();
  return bf16_backward(
      fn, a, dout, products,
      [&]() -> std::optional<AttentionGrads<bfloat16>> {
        if (c.conv_weight) return std::nullopt;
        return kernelized::linear_backward_bf16(products, a.q, a.k, a.v, dout, bf16_saved_results(fn, saved), c.opts);
      },
      [&](const MethodArgs<float>& w, TensorView<const float> dout32) {
        const auto c32 = kernelized::linear_call(w);
        Tensor<float> out32;
        return kernelized::linear_backward(products, w.q, w.k, w.v, dout32, saved_results(fn, saved, out32), c32.opts,
                                           c32.conv_weight);
      });
}

// favor_attention's products for a bfloat16 call: Bfloat16 where the CPU has AVX512-BF16 and
// the kernel is not trig.
Products favor_products(const kernelized::FavorCall<bfloat16>& c, const char* fn) {
  return parse_favor_kernel(fn, c.opts.kernel) != FeatureMapKind::FavorTrig ? bf16_products_where_usable()
                                                                            : Products::Native;
}

std::optional<MethodOutput<bfloat16>> favor_forward_bf16(const MethodArgs<bfloat16>& a) {
  const char* fn = "favor_attention";
  const auto c = kernelized::favor_call(a);
  const Products products = favor_products(c, fn);
  const Tensor<float> projection = widen(c.projection);
  return bf16_forward(
      fn, a, products,
      [&] { return kernelized::favor_forward_bf16(products, a.q, a.k, a.v, projection.view(), c.opts); },
      [&](const MethodArgs<float>& w) {
        return kernelized::favor_forward(products, w.q, w.k, w.v, projection.view(), c.opts);
      });
}

std::optional<AttentionGrads<bfloat16>> favor_backward_bf16(const MethodArgs<bfloat16>& a, TensorView<const bfloat16> dout,
                                                            const SavedViews<bfloat16>& saved) {
  const char* fn = "favor_attention_backward";
  const auto c = kernelized::favor_call(a);
  const Products products = favor_products(c, fn);
  const Tensor<float> projection = widen(c.projection);
  return bf16_backward(
      fn, a, dout, products,
      [&] {
        return kernelized::favor_backward_bf16(products, a.q, a.k, a.v, projection.view(), dout,
                                               bf16_saved_results(fn, saved), c.opts);
      },
      [&](const MethodArgs<float>& w, TensorView<const float> dout32) {
        Tensor<float> out32;
        return kernelized::favor_backward(products, w.q, w.k, w.v, projection.view(), dout32,
                                          saved_results(fn, saved, out32), c.opts);
      });
}

constexpr int64_t kDefaultFeatures = 256;

// den [B,H,n_q] and state [B,H,m',d_v+2] (kernelized.h).
const std::vector<std::vector<std::string>> kSavedDims = {{"batch", "heads", "n_q"},
                                                          {"batch", "heads", "features", "value_dim+2"}};

template <class T>
std::vector<std::pair<std::string, Tensor<T>>> favor_example(int64_t, int64_t head_dim, int64_t, int64_t size,
                                                             uint64_t seed) {
  std::vector<std::pair<std::string, Tensor<T>>> t;
  t.emplace_back("projection", random_features<T>(size > 0 ? size : kDefaultFeatures, head_dim,
                                                  FeatureKind::Orthogonal, seed));
  return t;
}

}  // namespace

MethodInfo describe_linear() {
  const LinearAttentionOptions defaults;
  MethodInfo m;
  m.name = "linear";
  m.function = "linear_attention";
  m.label = "linear elu";
  m.summary = "kernelized attention φ(q)(φ(k)ᵀv)/(φ(q)·Σφ(k) + eps) with φ = elu+1, relu, focused, or features "
              "given as q and k: O(n)";
  m.docs = "docs/methods/kernelized.md";
  m.options = {
      formerly_choice(kFormerGivenName, "given",
                      string_option("feature_map", defaults.feature_map, plain_feature_map_names(),
                                    fixed_feature_maps_help() + ", or given (q and k are features already, each >= 0, from a map of the caller's; "
                                    "'identity' before 0.2)")),
      causal_option(""),
      key_lengths_option(),
      float_option("eps", defaults.eps, "added to every denominator (finite, >= 0)"),
      float_option("focus_power", defaults.focus_power, "p of the focused map (1 to 1000)"),
      formerly("dwc_weight",
               tensor_input("conv_weight", false, true,
                            "[heads, K]: adds a depthwise convolution of v along the sequence (K odd unless causal)")),
  };
  m.saved = {"den", "state"};
  m.saved_dims = kSavedDims;
  m.feature_dim = [](int64_t head_dim, const auto&, const auto&) { return head_dim; };
  m.block_rows = kernelized::kBlockRows;
  // The convention FAVOR's count below sets, 4·n·m·(d + d_v), with m = d (this map has no
  // feature products, so it overstates the work); the backward twice that.
  m.flops = [](const AttentionShape& s, const MethodArgs<float>&, bool backward) {
    const double f = 2.0 * (s.n_q + s.n_k) * s.head_dim * (s.head_dim + s.value_dim) * s.bh();
    return backward ? 2 * f : f;
  };
  m.f32 = LINATTN_METHOD_FUNCTIONS(float, linear_forward, linear_backward, no_example_tensors);
  m.f64 = LINATTN_METHOD_FUNCTIONS(double, linear_forward, linear_backward, no_example_tensors);
  m.bf16_kernel = linear_forward_bf16;
  m.bf16_backward_kernel = linear_backward_bf16;
  return m;
}

MethodInfo describe_favor() {
  const FavorOptions defaults;
  MethodInfo m;
  m.name = "favor";
  m.function = "favor_attention";
  m.label = "favor+";
  m.summary = "Performer / FAVOR+: random features approximating softmax attention, O(n·m)";
  m.docs = "docs/methods/kernelized.md";
  m.options = {
      tensor_input("projection", true, false, "ω [num_features, head_dim] from random_features"),
      string_option("kernel", defaults.kernel, {"positive", "hyperbolic", "trig"},
                    "positive (FAVOR+), hyperbolic (±ω), or trig (sin/cos; its denominator can vanish)"),
      causal_option(""),
      key_lengths_option(),
      scale_option("approximates softmax(q·kᵀ·scale); None: 1/sqrt(head_dim); > 0"),
  };
  m.saved = {"den", "state"};
  m.saved_dims = kSavedDims;
  // m' = num_features, twice that for the kernels with two features per row of ω.
  m.feature_dim = [defaults](int64_t, const std::map<std::string, Shape, std::less<>>& tensors,
                             const std::map<std::string, OptionValue, std::less<>>& options) -> int64_t {
    const auto w = tensors.find("projection");
    require(w != tensors.end() && !w->second.empty(), "favor_attention: projection is required");
    const auto k = options.find("kernel");
    const std::string kernel = k != options.end() ? std::get<std::string>(k->second) : defaults.kernel;
    return w->second[0] * (kernel == "positive" ? 1 : 2);
  };
  m.size_name = "num_features";
  m.size_symbol = "m";
  m.default_size = kDefaultFeatures;
  m.block_rows = kernelized::kBlockRows;
  // Per head: the logits of q and k, 2·n·m·d each, and KV = φ(k)ᵀV, φ(q)·KV, 2·n·m·d_v each:
  // 4·n·m·(d + d_v) (positive features; the normaliser column left out); the backward twice that.
  m.flops = [](const AttentionShape& s, const MethodArgs<float>& a, bool backward) {
    const auto w = a.tensors.find("projection");
    const double mm = w != a.tensors.end() ? static_cast<double>(w->second.dim(0)) : kDefaultFeatures;
    const double f = 2.0 * (s.n_q + s.n_k) * mm * (s.head_dim + s.value_dim) * s.bh();
    return backward ? 2 * f : f;
  };
  m.f32 = LINATTN_METHOD_FUNCTIONS(float, favor_forward, favor_backward, favor_example);
  m.f64 = LINATTN_METHOD_FUNCTIONS(double, favor_forward, favor_backward, favor_example);
  m.bf16_kernel = favor_forward_bf16;
  m.bf16_backward_kernel = favor_backward_bf16;
  return m;
}

}  // namespace linattn
