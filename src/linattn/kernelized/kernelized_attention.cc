// linear_attention and favor_attention: argument checks, feature map set-up, the engine, and
// the depthwise convolution of focused linear attention.
#include "linattn/kernelized/kernelized_attention.h"

#include <cmath>

#include "linattn/core/depthwise_conv.h"
#include "linattn/kernelized/engine.h"
#include "linattn/kernelized/feature_map.h"

namespace linattn {
namespace {

AttentionOptions mask_options(bool causal, const std::optional<std::vector<int64_t>>& lengths,
                              std::optional<double> scale = std::nullopt) {
  AttentionOptions o;
  o.causal = causal;
  o.key_lengths = lengths;
  o.scale = scale;
  return o;
}

template <class T>
AttentionDims check_common(const char* fn, TensorView<const T> q, TensorView<const T> k,
                           TensorView<const T> v, const AttentionOptions& o) {
  const AttentionDims d = check_attention_args(fn, q, k, v, o);
  require(!o.causal || d.n_q == d.n_k, fn, ": causal=true needs n_q == n_k (got n_q = ", d.n_q,
          ", n_k = ", d.n_k, "); to decode one token at a time use recurrent_state");
  return d;
}

template <class T>
FeatureMap<T> plain_map(const char* fn, const LinearAttentionOptions& o, int64_t head_dim) {
  require(std::isfinite(o.eps) && o.eps >= 0, fn, ": eps must be finite and >= 0, got ", o.eps);
  return FeatureMap<T>::plain(fn, parse_plain_feature_map(fn, o.feature_map), head_dim,
                              o.focus_power);
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
  const AttentionOptions mo = mask_options(opts.causal, opts.key_lengths);
  const AttentionDims d = check_common(fn, q, k, v, mo);
  const FeatureMap<T> fmap = plain_map<T>(fn, opts, d.head_dim);
  if (dwc_weight) check_depthwise_conv(fn, "dwc_weight", d, opts.causal, *dwc_weight);
  const KeyMask mask(d, mo);
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim});
  kernelized::forward<T>({fn, q, k, v, d, &mask, &fmap, static_cast<T>(opts.eps)}, out.data());
  if (dwc_weight) depthwise_conv_forward(v, *dwc_weight, d, mask, opts.causal, out.data());
  return out;
}

template <class T>
KernelizedGrads<T> linear_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                             TensorView<const T> v, TensorView<const T> dout,
                                             const LinearAttentionOptions& opts,
                                             std::optional<TensorView<const T>> dwc_weight) {
  const char* fn = "linear_attention_backward";
  const AttentionOptions mo = mask_options(opts.causal, opts.key_lengths);
  const AttentionDims d = check_common(fn, q, k, v, mo);
  const FeatureMap<T> fmap = plain_map<T>(fn, opts, d.head_dim);
  check_same_shape_finite(fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  if (dwc_weight) check_depthwise_conv(fn, "dwc_weight", d, opts.causal, *dwc_weight);
  const KeyMask mask(d, mo);
  KernelizedGrads<T> g{Tensor<T>(q.shape), Tensor<T>(k.shape), Tensor<T>(v.shape), Tensor<T>()};
  kernelized::backward<T>({fn, q, k, v, d, &mask, &fmap, static_cast<T>(opts.eps)}, dout.data,
                          g.dq.data(), g.dk.data(), g.dv.data());
  if (dwc_weight) {
    g.d_dwc_weight = Tensor<T>(dwc_weight->shape);
    depthwise_conv_backward(v, *dwc_weight, dout.data, d, mask, opts.causal, g.dv.data(), g.d_dwc_weight.data());
  }
  return g;
}

template <class T>
Tensor<T> favor_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                          TensorView<const T> projection, const FavorOptions& opts) {
  const char* fn = "favor_attention";
  const AttentionOptions mo = mask_options(opts.causal, opts.key_lengths, opts.scale);
  const AttentionDims d = check_common(fn, q, k, v, mo);
  const FeatureMap<T> fmap = favor_map(fn, opts, d, projection);
  const KeyMask mask(d, mo);
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim});
  kernelized::forward<T>({fn, q, k, v, d, &mask, &fmap, T(0)}, out.data());
  return out;
}

template <class T>
AttentionGrads<T> favor_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                           TensorView<const T> v, TensorView<const T> projection,
                                           TensorView<const T> dout, const FavorOptions& opts) {
  const char* fn = "favor_attention_backward";
  const AttentionOptions mo = mask_options(opts.causal, opts.key_lengths, opts.scale);
  const AttentionDims d = check_common(fn, q, k, v, mo);
  const FeatureMap<T> fmap = favor_map(fn, opts, d, projection);
  check_same_shape_finite(fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  const KeyMask mask(d, mo);
  AttentionGrads<T> g{Tensor<T>(q.shape), Tensor<T>(k.shape), Tensor<T>(v.shape)};
  kernelized::backward<T>({fn, q, k, v, d, &mask, &fmap, T(0)}, dout.data, g.dq.data(), g.dk.data(),
                          g.dv.data());
  return g;
}

#define LINATTN_INSTANTIATE(T)                                                                  \
  template Tensor<T> linear_attention(TensorView<const T>, TensorView<const T>,                 \
                                      TensorView<const T>, const LinearAttentionOptions&,       \
                                      std::optional<TensorView<const T>>);                      \
  template KernelizedGrads<T> linear_attention_backward(                                        \
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
