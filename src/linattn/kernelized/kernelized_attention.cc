// linear_attention and favor_attention: argument checks, feature map set-up, the engine, and
// the depthwise convolution of focused linear attention.
#include <cmath>

#include "linattn/core/attention_args.h"
#include "linattn/core/depthwise_conv.h"
#include "linattn/core/error.h"
#include "linattn/core/range.h"
#include "linattn/kernelized.h"
#include "linattn/kernelized/engine.h"
#include "linattn/kernelized/feature_map.h"

namespace linattn {
namespace {

template <class T>
AttentionDims check_common(const char* fn, TensorView<const T> q, TensorView<const T> k,
                           TensorView<const T> v, const AttentionOptions& o) {
  const AttentionDims d = check_attention_args(fn, q, k, v, o);
  require(!o.causal || d.n_q == d.n_k, fn, ": causal=true needs n_q == n_k (got n_q = ", d.n_q,
          ", n_k = ", d.n_k, "); to decode one token at a time use recurrent_state");
  return d;
}

// The plain maps' largest feature for inputs of largest |value| x: elu+1 <= x + 1, relu <= x,
// focused = ‖r‖·rᵖ/‖rᵖ‖ <= ‖r‖ <= √d·x.
double plain_feature_bound(FeatureMapKind kind, double x, int64_t d) {
  switch (kind) {
    case FeatureMapKind::Elu: return x + 1;
    case FeatureMapKind::Relu: return x;
    default: return std::sqrt(static_cast<double>(d)) * x;
  }
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

template <class T>
FeatureMap<T> favor_map(const char* fn, const FavorOptions& o, const AttentionDims& d,
                        TensorView<const T> projection) {
  return FeatureMap<T>::favor(fn, parse_favor_kernel(fn, o.kernel), projection, d.head_dim, o.scale);
}

}  // namespace

template <class T>
Tensor<T> linear_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                           const LinearAttentionOptions& opts,
                           std::optional<TensorView<const T>> dwc_weight) {
  const char* fn = "linear_attention";
  const AttentionDims d = check_common(fn, q, k, v, opts);
  const ValueScale<T> vs(v, d.v_max);
  const FeatureMap<T> fmap = plain_map<T>(fn, opts, d, vs.max_abs(d.v_max));
  if (dwc_weight) check_depthwise_conv(fn, "dwc_weight", d, opts.causal, *dwc_weight);
  const KeyMask mask(d, opts);
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim}, false, Init::Uninitialized);
  kernelized::forward<T>({fn, q, k, vs.view(), d, &mask, &fmap, static_cast<T>(opts.eps)}, out.data());
  if (dwc_weight) depthwise_conv_forward(vs.view(), *dwc_weight, d, mask, opts.causal, out.data());
  vs.restore(out);
  check_result_finite(fn, "the output", out);
  return out;
}

template <class T>
AttentionGrads<T> linear_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                            TensorView<const T> v, TensorView<const T> dout,
                                            const LinearAttentionOptions& opts,
                                            std::optional<TensorView<const T>> dwc_weight) {
  const char* fn = "linear_attention_backward";
  const AttentionDims d = check_common(fn, q, k, v, opts);
  const double dout_max = check_same_shape_finite(fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  const ValueScale<T> vs(v, d.v_max), gs(dout, dout_max);
  const FeatureMap<T> fmap = plain_map<T>(fn, opts, d, vs.max_abs(d.v_max));
  if (dwc_weight) check_depthwise_conv(fn, "dwc_weight", d, opts.causal, *dwc_weight);
  const KeyMask mask(d, opts);
  AttentionGrads<T> g{Tensor<T>(q.shape), Tensor<T>(k.shape), Tensor<T>(v.shape), {}};
  kernelized::backward<T>({fn, q, k, vs.view(), d, &mask, &fmap, static_cast<T>(opts.eps)}, gs.view().data,
                          g.dq.data(), g.dk.data(), g.dv.data());
  if (dwc_weight) {
    Tensor<T> dw(dwc_weight->shape);
    depthwise_conv_backward(vs.view(), *dwc_weight, gs.view().data, d, mask, opts.causal, g.dv.data(),
                            dw.data());
    g.params.emplace_back("dwc_weight", std::move(dw));
  }
  restore_gradients(fn, g, vs.exponent(), gs.exponent());
  return g;
}

template <class T>
Tensor<T> favor_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                          TensorView<const T> projection, const FavorOptions& opts) {
  const char* fn = "favor_attention";
  const AttentionDims d = check_common(fn, q, k, v, opts);
  const FeatureMap<T> fmap = favor_map(fn, opts, d, projection);
  const ValueScale<T> vs(v, d.v_max);
  const KeyMask mask(d, opts);
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim}, false, Init::Uninitialized);
  kernelized::forward<T>({fn, q, k, vs.view(), d, &mask, &fmap, T(0)}, out.data());
  vs.restore(out);
  check_result_finite(fn, "the output", out);
  return out;
}

template <class T>
AttentionGrads<T> favor_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                           TensorView<const T> v, TensorView<const T> projection,
                                           TensorView<const T> dout, const FavorOptions& opts) {
  const char* fn = "favor_attention_backward";
  const AttentionDims d = check_common(fn, q, k, v, opts);
  const FeatureMap<T> fmap = favor_map(fn, opts, d, projection);
  const double dout_max = check_same_shape_finite(fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  const ValueScale<T> vs(v, d.v_max), gs(dout, dout_max);
  const KeyMask mask(d, opts);
  AttentionGrads<T> g{Tensor<T>(q.shape), Tensor<T>(k.shape), Tensor<T>(v.shape), {}};
  kernelized::backward<T>({fn, q, k, vs.view(), d, &mask, &fmap, T(0)}, gs.view().data, g.dq.data(),
                          g.dk.data(), g.dv.data());
  restore_gradients(fn, g, vs.exponent(), gs.exponent());
  return g;
}

#define LINATTN_INSTANTIATE(T)                                                                  \
  template Tensor<T> linear_attention(TensorView<const T>, TensorView<const T>,                 \
                                      TensorView<const T>, const LinearAttentionOptions&,       \
                                      std::optional<TensorView<const T>>);                      \
  template AttentionGrads<T> linear_attention_backward(                                         \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,       \
      const LinearAttentionOptions&, std::optional<TensorView<const T>>);                       \
  template Tensor<T> favor_attention(TensorView<const T>, TensorView<const T>,                  \
                                     TensorView<const T>, TensorView<const T>,                  \
                                     const FavorOptions&);                                      \
  template AttentionGrads<T> favor_attention_backward(TensorView<const T>, TensorView<const T>, \
                                                      TensorView<const T>, TensorView<const T>, \
                                                      TensorView<const T>, const FavorOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
