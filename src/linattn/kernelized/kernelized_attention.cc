// linear_attention and favor_attention: argument checks, feature map set-up, the engine, and
// the depthwise convolution of focused linear attention.
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include "linattn/core/attention_args.h"
#include "linattn/core/depthwise_conv.h"
#include "linattn/core/error.h"
#include "linattn/core/range.h"
#include "linattn/kernelized.h"
#include "linattn/kernelized/engine.h"
#include "linattn/kernelized/products_calls.h"
#include "linattn/core/feature_map.h"

namespace linattn {
namespace {

template <class S>
AttentionDims check_common(const char* fn, TensorView<const S> q, TensorView<const S> k,
                           TensorView<const S> v, const AttentionOptions& o) {
  const AttentionDims d = check_attention_args(fn, q, k, v, o);
  require(!o.causal || d.n_q == d.n_k, fn, ": causal=true needs n_q == n_k (got n_q = ", d.n_q,
          ", n_k = ", d.n_k, "); to decode one token at a time use recurrent_state");
  return d;
}

template <class T>
FeatureMap<T> plain_map(const char* fn, const LinearAttentionOptions& o, const AttentionDims& d,
                        double v_max) {
  require(!o.scale, fn, ": scale is not used by linear attention (its feature maps take q and k "
          "as they are); leave it unset");
  require(std::isfinite(o.eps) && o.eps >= 0, fn, ": eps must be finite and >= 0, got ", o.eps);
  const FeatureMapKind kind = parse_plain_feature_map(fn, o.feature_map);
  // num_i = φ(q_i)·Σ_j φ(k_j)v_jᵀ and den_i are sums of d·n_k products of features and values:
  // refuse inputs whose bound on them leaves the dtype's range (rather than return inf/inf).
  const double bound = static_cast<double>(d.head_dim) * static_cast<double>(std::max<int64_t>(d.n_k, 1)) *
                       plain_feature_bound(kind, d.q_max, d.head_dim) *
                       plain_feature_bound(kind, d.k_max, d.head_dim) * std::max(1.0, v_max);
  require(bound <= std::ldexp(1.0, std::numeric_limits<T>::max_exponent - 8), fn, ": q and k are too large for ",
          dtype_name<T>(), " with feature_map=\"", o.feature_map, "\": the attention sums reach ", bound,
          " (max |q| = ", d.q_max, ", max |k| = ", d.k_max, ", over ", d.n_k,
          " keys), beyond the dtype's range; scale q and k down or use float64");
  return FeatureMap<T>::plain(fn, kind, d.head_dim, o.focus_power);
}

// FAVOR's map, refusing bfloat16 products for the trig kernel, whose signed features would let
// the operands' rounding errors outgrow the denominator.
template <class T>
FeatureMap<T> favor_map(const char* fn, const FavorOptions& o, const AttentionDims& d, TensorView<const T> projection,
                        Products products = Products::Native) {
  FeatureMap<T> map = FeatureMap<T>::favor(fn, parse_favor_kernel(fn, o.kernel), projection, d.head_dim, o.scale);
  require(products == Products::Native || !map.has_factor(), fn,
          ": bfloat16 products are not for the trig kernel (its features are signed)");
  if constexpr (std::is_same_v<T, float>)
    if (products == Products::Bfloat16) map.pack_projection();
  return map;
}

// The saved tensors a backward was given: out [B,H,n_q,d_v] and den [B,H,n_q] finite, state
// [B,H,m',d_v+2] with S and z finite and each shift c finite or −inf. out is T, or bfloat16 as a
// bfloat16 forward returned it.
template <class T, class O>
void check_saved(const char* fn, const AttentionDims& d, int64_t features, TensorView<const O> out,
                 TensorView<const T> den, TensorView<const T> state) {
  check_same_shape_finite(fn, "out", out, {d.batch, d.heads, d.n_q, d.value_dim});
  check_same_shape_finite(fn, "den", den, {d.batch, d.heads, d.n_q});
  const Shape expected{d.batch, d.heads, features, d.value_dim + 2};
  require(state.shape == expected, fn, ": state has shape ", shape_string(state.shape), "; expected ",
          shape_string(expected), " (from the forward with the same options)");
  const int64_t row = d.value_dim + 2;
  for (int64_t i = 0; i < state.size(); ++i) {
    const T x = state.data[i];
    const bool shift = i % row == row - 1;
    require(std::isfinite(x) || (shift && x == -std::numeric_limits<T>::infinity()), fn, ": state[", i, "] = ", x,
            shift ? "; expected a finite value or -inf" : "; expected a finite value");
  }
}

// The engine's forward: out restored to v's scale and checked; with `save`, den and state too.
// conv_weight (linear attention only) adds its convolution to out.
template <class T>
KernelizedAttentionResult<T> run_forward(const kernelized::Problem<T>& p, const ValueScale<T>& vs,
                                         const std::optional<TensorView<const T>>& conv_weight, bool save) {
  const AttentionDims& d = p.dims;
  KernelizedAttentionResult<T> r;
  r.out = Tensor<T>({d.batch, d.heads, d.n_q, d.value_dim}, false, Init::Uninitialized);
  if (save) {
    r.den = Tensor<T>({d.batch, d.heads, d.n_q}, false, Init::Uninitialized);
    r.state = Tensor<T>({d.batch, d.heads, p.fmap->dim(), d.value_dim + 2}, false, Init::Uninitialized);
  }
  kernelized::forward<T>(p, r.out.data(), {save ? r.den.data() : nullptr, save ? r.state.data() : nullptr});
  if (conv_weight) depthwise_conv_forward(vs.view(), *conv_weight, d, *p.mask, p.mask->causal(), r.out.data());
  vs.restore(r.out);
  check_result_finite(p.fn, "the output", r.out);
  return r;
}

// The engine's backward, from `saved` (checked) or, without it, from a forward run here first
// (into workspace memory: the attention output alone, den, and the state when non-causal).
// Gradients are linear in v and dout (range.h); the saved out scales with v, and with a
// conv_weight it holds the convolution too, so the engine computes the attention part again.
template <class T>
AttentionGrads<T> run_backward(const kernelized::Problem<T>& p, const ValueScale<T>& vs, TensorView<const T> dout,
                               const std::optional<TensorView<const T>>& conv_weight,
                               const std::optional<kernelized::SavedResults<T>>& saved) {
  const AttentionDims& d = p.dims;
  const bool causal = p.mask->causal();
  const double dout_max = check_same_shape_finite(p.fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  const ValueScale<T> gs(dout, dout_max);
  std::optional<ValueScale<T>> os;
  Tensor<T> out, den, state;
  const T *out_p = nullptr, *den_p = nullptr, *state_p = nullptr;
  if (saved) {
    check_saved(p.fn, d, p.fmap->dim(), saved->out, saved->den, saved->state);
    os.emplace(saved->out, vs);
    out_p = conv_weight ? nullptr : os->view().data;
    den_p = saved->den.data;
    state_p = saved->state.data;
  } else {
    out = Tensor<T>({d.batch, d.heads, d.n_q, d.value_dim}, true, Init::Uninitialized);
    den = Tensor<T>({d.batch, d.heads, d.n_q}, true, Init::Uninitialized);
    if (!causal) state = Tensor<T>({d.batch, d.heads, p.fmap->dim(), d.value_dim + 2}, true, Init::Uninitialized);
    kernelized::forward<T>(p, out.data(), {den.data(), causal ? nullptr : state.data()});
    out_p = out.data(), den_p = den.data(), state_p = causal ? nullptr : state.data();
  }
  // The engine writes every element of dq, dk and dv (padded keys' rows with 0).
  AttentionGrads<T> g{Tensor<T>(p.q.shape, false, Init::Uninitialized), Tensor<T>(p.k.shape, false, Init::Uninitialized),
                      Tensor<T>(p.v.shape, false, Init::Uninitialized), {}};
  const bool finite =
      kernelized::backward<T>(p, gs.view().data, out_p, den_p, state_p, g.dq.data(), g.dk.data(), g.dv.data());
  if (conv_weight) {
    Tensor<T> dw(conv_weight->shape);
    depthwise_conv_backward(vs.view(), *conv_weight, gs.view().data, d, *p.mask, causal, g.dv.data(), dw.data());
    g.params.emplace_back("conv_weight", std::move(dw));
  }
  // dv is checked again after the convolution added to it.
  restore_gradients(p.fn, g, vs.exponent(), gs.exponent(), {finite, finite, finite && !conv_weight});
  return g;
}

// Everything a linear_attention call sets up before the engine runs.
template <class T>
struct LinearSetup {
  LinearSetup(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
              const LinearAttentionOptions& opts, const std::optional<TensorView<const T>>& conv_weight,
              Products products = Products::Native)
      : d(check_common(fn, q, k, v, opts)),
        vs(v, d.v_max),
        fmap(plain_map<T>(fn, opts, d, vs.max_abs(d.v_max))),
        mask(d, opts),
        problem{fn, q, k, vs.view(), d, &mask, &fmap, static_cast<T>(opts.eps), products} {
    if (conv_weight) check_depthwise_conv(fn, "conv_weight", d, opts.causal, *conv_weight);
    check_given_features(fn, "q", fmap, q);
    check_given_features(fn, "k", fmap, k, &mask);
  }
  AttentionDims d;
  ValueScale<T> vs;
  FeatureMap<T> fmap;
  KeyMask mask;
  kernelized::Problem<T> problem;
};

// Everything a favor_attention call sets up before the engine runs.
template <class T>
struct FavorSetup {
  FavorSetup(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
             TensorView<const T> projection, const FavorOptions& opts, Products products = Products::Native)
      : d(check_common(fn, q, k, v, opts)),
        fmap(favor_map(fn, opts, d, projection, products)),
        vs(v, d.v_max),
        mask(d, opts),
        problem{fn, q, k, vs.view(), d, &mask, &fmap, T(0), products} {}
  AttentionDims d;
  FeatureMap<T> fmap;
  ValueScale<T> vs;
  KeyMask mask;
  kernelized::Problem<T> problem;
};

}  // namespace

template <class T>
Tensor<T> linear_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                           const LinearAttentionOptions& opts,
                           std::optional<TensorView<const T>> conv_weight) {
  const LinearSetup<T> s("linear_attention", q, k, v, opts, conv_weight);
  return run_forward(s.problem, s.vs, conv_weight, false).out;
}

template <class T>
KernelizedAttentionResult<T> linear_attention_with_saved(TensorView<const T> q, TensorView<const T> k,
                                                         TensorView<const T> v, const LinearAttentionOptions& opts,
                                                         std::optional<TensorView<const T>> conv_weight) {
  const LinearSetup<T> s("linear_attention", q, k, v, opts, conv_weight);
  return run_forward(s.problem, s.vs, conv_weight, true);
}

template <class T>
AttentionGrads<T> linear_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                            TensorView<const T> v, TensorView<const T> dout,
                                            const LinearAttentionOptions& opts,
                                            std::optional<TensorView<const T>> conv_weight) {
  const LinearSetup<T> s("linear_attention_backward", q, k, v, opts, conv_weight);
  return run_backward<T>(s.problem, s.vs, dout, conv_weight, std::nullopt);
}

template <class T>
AttentionGrads<T> linear_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                            TensorView<const T> v, TensorView<const T> dout,
                                            TensorView<const T> out, TensorView<const T> den,
                                            TensorView<const T> state, const LinearAttentionOptions& opts,
                                            std::optional<TensorView<const T>> conv_weight) {
  const LinearSetup<T> s("linear_attention_backward", q, k, v, opts, conv_weight);
  return run_backward<T>(s.problem, s.vs, dout, conv_weight, kernelized::SavedResults<T>{out, den, state});
}

template <class T>
Tensor<T> favor_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                          TensorView<const T> projection, const FavorOptions& opts) {
  const FavorSetup<T> s("favor_attention", q, k, v, projection, opts);
  return run_forward<T>(s.problem, s.vs, std::nullopt, false).out;
}

template <class T>
KernelizedAttentionResult<T> favor_attention_with_saved(TensorView<const T> q, TensorView<const T> k,
                                                        TensorView<const T> v, TensorView<const T> projection,
                                                        const FavorOptions& opts) {
  const FavorSetup<T> s("favor_attention", q, k, v, projection, opts);
  return run_forward<T>(s.problem, s.vs, std::nullopt, true);
}

template <class T>
AttentionGrads<T> favor_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                           TensorView<const T> v, TensorView<const T> projection,
                                           TensorView<const T> dout, const FavorOptions& opts) {
  const FavorSetup<T> s("favor_attention_backward", q, k, v, projection, opts);
  return run_backward<T>(s.problem, s.vs, dout, std::nullopt, std::nullopt);
}

template <class T>
AttentionGrads<T> favor_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                           TensorView<const T> v, TensorView<const T> projection,
                                           TensorView<const T> dout, TensorView<const T> out,
                                           TensorView<const T> den, TensorView<const T> state,
                                           const FavorOptions& opts) {
  const FavorSetup<T> s("favor_attention_backward", q, k, v, projection, opts);
  return run_backward<T>(s.problem, s.vs, dout, std::nullopt, kernelized::SavedResults<T>{out, den, state});
}

namespace {

// ---- bfloat16 calls on the engine reading bfloat16 (products_calls.h) ----------------------

// The largest |v| and |dout| the float32 code takes without rescaling them.
const double kUnscaledMax = ValueScale<float>::unscaled_max();

// A bfloat16 call's engine problem over the inputs as they are, with its float32 map.
struct Bf16Problem {
  Bf16Problem(const char* fn, const AttentionDims& dims, TensorView<const bfloat16> q, TensorView<const bfloat16> k,
              TensorView<const bfloat16> v, const AttentionOptions& opts, FeatureMap<float> map, float eps,
              Products products)
      : fmap(std::move(map)), mask(dims, opts), problem{fn, q, k, v, dims, &mask, &fmap, eps, products} {}
  Bf16Problem(const Bf16Problem&) = delete;
  FeatureMap<float> fmap;
  KeyMask mask;
  kernelized::Problem<float, bfloat16> problem;
};

kernelized::Bf16Forward run_forward_bf16(const kernelized::Problem<float, bfloat16>& p) {
  const AttentionDims& d = p.dims;
  kernelized::Bf16Forward r{Tensor<bfloat16>({d.batch, d.heads, d.n_q, d.value_dim}, false, Init::Uninitialized),
                            Tensor<float>({d.batch, d.heads, d.n_q}, false, Init::Uninitialized),
                            Tensor<float>({d.batch, d.heads, p.fmap->dim(), d.value_dim + 2}, false, Init::Uninitialized)};
  // The engine checked the output as it rounded it; only where it found a value that is not
  // finite does the whole check run, for the error.
  if (!kernelized::forward(p, r.out.data(), {r.den.data(), r.state.data()})) check_result_finite(p.fn, "the output", r.out);
  return r;
}

// run_backward's, for a call whose v needed no rescaling; nullopt when dout would.
std::optional<AttentionGrads<bfloat16>> run_backward_bf16(const kernelized::Problem<float, bfloat16>& p,
                                                          TensorView<const bfloat16> dout,
                                                          const std::optional<kernelized::Bf16SavedResults>& saved) {
  const AttentionDims& d = p.dims;
  const bool causal = p.mask->causal();
  const double dout_max = check_same_shape_finite(p.fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  if (dout_max > kUnscaledMax) return std::nullopt;
  Tensor<float> den, state;
  const float *out_p = nullptr, *den_p = nullptr, *state_p = nullptr;
  const bfloat16* out16 = nullptr;  // the saved out as the forward returned it
  if (saved) {
    const kernelized::SavedResults<float>& w = saved->widened;
    if (saved->out_as_returned) {
      check_saved(p.fn, d, p.fmap->dim(), *saved->out_as_returned, w.den, w.state);
      out16 = saved->out_as_returned->data;
    } else {
      check_saved(p.fn, d, p.fmap->dim(), w.out, w.den, w.state);
      out_p = w.out.data;
    }
    den_p = w.den.data, state_p = w.state.data;
  } else {  // den and state from a forward here (no output); the backward computes the output in float32
    den = Tensor<float>({d.batch, d.heads, d.n_q}, true, Init::Uninitialized);
    if (!causal) state = Tensor<float>({d.batch, d.heads, p.fmap->dim(), d.value_dim + 2}, true, Init::Uninitialized);
    kernelized::forward(p, static_cast<bfloat16*>(nullptr), {den.data(), causal ? nullptr : state.data()});
    den_p = den.data(), state_p = causal ? nullptr : state.data();
  }
  AttentionGrads<bfloat16> g{Tensor<bfloat16>(p.q.shape, false, Init::Uninitialized),
                             Tensor<bfloat16>(p.k.shape, false, Init::Uninitialized),
                             Tensor<bfloat16>(p.v.shape, false, Init::Uninitialized), {}};
  const bool finite = out16 ? kernelized::backward(p, dout.data, out16, den_p, state_p, g.dq.data(), g.dk.data(), g.dv.data())
                            : kernelized::backward(p, dout.data, out_p, den_p, state_p, g.dq.data(), g.dk.data(), g.dv.data());
  if (!finite) {
    // Which one: the first of them that is not finite is the error.
    check_result_finite(p.fn, "dq", g.dq);
    check_result_finite(p.fn, "dk", g.dk);
    check_result_finite(p.fn, "dv", g.dv);
  }
  return g;
}

// run(problem) for a bfloat16 linear_attention call, or nullopt where v needs rescaling.
template <class Run>
auto with_linear_problem(const char* fn, Products products, TensorView<const bfloat16> q, TensorView<const bfloat16> k,
                         TensorView<const bfloat16> v, const LinearAttentionOptions& opts, Run run)
    -> std::optional<typename decltype(run(std::declval<const kernelized::Problem<float, bfloat16>&>()))::value_type> {
  const AttentionDims d = check_common(fn, q, k, v, opts);
  if (d.v_max > kUnscaledMax) return std::nullopt;
  const Bf16Problem b(fn, d, q, k, v, opts, plain_map<float>(fn, opts, d, d.v_max), static_cast<float>(opts.eps),
                      products);
  check_given_features(fn, "q", b.fmap, q);
  check_given_features(fn, "k", b.fmap, k, &b.mask);
  return run(b.problem);
}

// The same for favor_attention.
template <class Run>
auto with_favor_problem(const char* fn, Products products, TensorView<const bfloat16> q, TensorView<const bfloat16> k,
                        TensorView<const bfloat16> v, TensorView<const float> projection, const FavorOptions& opts, Run run)
    -> std::optional<typename decltype(run(std::declval<const kernelized::Problem<float, bfloat16>&>()))::value_type> {
  const AttentionDims d = check_common(fn, q, k, v, opts);
  if (d.v_max > kUnscaledMax) return std::nullopt;
  const Bf16Problem b(fn, d, q, k, v, opts, favor_map(fn, opts, d, projection, products), 0.0f, products);
  return run(b.problem);
}

}  // namespace

namespace kernelized {

std::optional<Bf16Forward> linear_forward_bf16(Products products, TensorView<const bfloat16> q,
                                               TensorView<const bfloat16> k, TensorView<const bfloat16> v,
                                               const LinearAttentionOptions& opts) {
  return with_linear_problem("linear_attention", products, q, k, v, opts,
                             [](const auto& p) { return std::optional(run_forward_bf16(p)); });
}

std::optional<AttentionGrads<bfloat16>> linear_backward_bf16(Products products, TensorView<const bfloat16> q,
                                                             TensorView<const bfloat16> k, TensorView<const bfloat16> v,
                                                             TensorView<const bfloat16> dout,
                                                             const std::optional<Bf16SavedResults>& saved,
                                                             const LinearAttentionOptions& opts) {
  return with_linear_problem("linear_attention_backward", products, q, k, v, opts,
                             [&](const auto& p) { return run_backward_bf16(p, dout, saved); });
}

std::optional<Bf16Forward> favor_forward_bf16(Products products, TensorView<const bfloat16> q, TensorView<const bfloat16> k,
                                              TensorView<const bfloat16> v, TensorView<const float> projection,
                                              const FavorOptions& opts) {
  return with_favor_problem("favor_attention", products, q, k, v, projection, opts,
                            [](const auto& p) { return std::optional(run_forward_bf16(p)); });
}

std::optional<AttentionGrads<bfloat16>> favor_backward_bf16(Products products, TensorView<const bfloat16> q,
                                                            TensorView<const bfloat16> k, TensorView<const bfloat16> v,
                                                            TensorView<const float> projection,
                                                            TensorView<const bfloat16> dout,
                                                            const std::optional<Bf16SavedResults>& saved,
                                                            const FavorOptions& opts) {
  return with_favor_problem("favor_attention_backward", products, q, k, v, projection, opts,
                            [&](const auto& p) { return run_backward_bf16(p, dout, saved); });
}

KernelizedAttentionResult<float> linear_forward(Products products, TensorView<const float> q, TensorView<const float> k,
                                                TensorView<const float> v, const LinearAttentionOptions& opts,
                                                std::optional<TensorView<const float>> conv_weight) {
  const LinearSetup<float> s("linear_attention", q, k, v, opts, conv_weight, products);
  return run_forward(s.problem, s.vs, conv_weight, true);
}

AttentionGrads<float> linear_backward(Products products, TensorView<const float> q, TensorView<const float> k,
                                      TensorView<const float> v, TensorView<const float> dout,
                                      const std::optional<SavedResults<float>>& saved, const LinearAttentionOptions& opts,
                                      std::optional<TensorView<const float>> conv_weight) {
  const LinearSetup<float> s("linear_attention_backward", q, k, v, opts, conv_weight, products);
  return run_backward<float>(s.problem, s.vs, dout, conv_weight, saved);
}

KernelizedAttentionResult<float> favor_forward(Products products, TensorView<const float> q, TensorView<const float> k,
                                               TensorView<const float> v, TensorView<const float> projection,
                                               const FavorOptions& opts) {
  const FavorSetup<float> s("favor_attention", q, k, v, projection, opts, products);
  return run_forward<float>(s.problem, s.vs, std::nullopt, true);
}

AttentionGrads<float> favor_backward(Products products, TensorView<const float> q, TensorView<const float> k,
                                     TensorView<const float> v, TensorView<const float> projection,
                                     TensorView<const float> dout, const std::optional<SavedResults<float>>& saved,
                                     const FavorOptions& opts) {
  const FavorSetup<float> s("favor_attention_backward", q, k, v, projection, opts, products);
  return run_backward<float>(s.problem, s.vs, dout, std::nullopt, saved);
}

}  // namespace kernelized

#define LINATTN_INSTANTIATE(T)                                                                          \
  template Tensor<T> linear_attention(TensorView<const T>, TensorView<const T>, TensorView<const T>,    \
                                      const LinearAttentionOptions&, std::optional<TensorView<const T>>); \
  template KernelizedAttentionResult<T> linear_attention_with_saved(                                    \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, const LinearAttentionOptions&,     \
      std::optional<TensorView<const T>>);                                                              \
  template AttentionGrads<T> linear_attention_backward(                                                 \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,               \
      const LinearAttentionOptions&, std::optional<TensorView<const T>>);                               \
  template AttentionGrads<T> linear_attention_backward(                                                 \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,               \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, const LinearAttentionOptions&,     \
      std::optional<TensorView<const T>>);                                                              \
  template Tensor<T> favor_attention(TensorView<const T>, TensorView<const T>, TensorView<const T>,     \
                                     TensorView<const T>, const FavorOptions&);                        \
  template KernelizedAttentionResult<T> favor_attention_with_saved(                                     \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,               \
      const FavorOptions&);                                                                             \
  template AttentionGrads<T> favor_attention_backward(TensorView<const T>, TensorView<const T>,         \
                                                      TensorView<const T>, TensorView<const T>,         \
                                                      TensorView<const T>, const FavorOptions&);        \
  template AttentionGrads<T> favor_attention_backward(                                                  \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,               \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,               \
      const FavorOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
