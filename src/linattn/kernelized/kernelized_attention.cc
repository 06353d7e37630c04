// linear_attention and favor_attention: argument checks, feature map set-up, the engine, and
// the depthwise convolution of focused linear attention.
#include "linattn/kernelized/kernelized_attention.h"

#include <cmath>

#include "linattn/core/simd.h"
#include "linattn/core/threading.h"
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
void check_dwc(const char* fn, const AttentionDims& d, bool causal, TensorView<const T> w) {
  require(w.rank() == 2 && w.dim(0) == d.heads && w.dim(1) >= 1, fn,
          ": dwc_weight has shape ", shape_string(w.shape), "; expected [heads = ", d.heads, ", K]");
  require(causal || w.dim(1) % 2 == 1, fn, ": dwc_weight needs an odd K when causal=false (got K = ",
          w.dim(1), ") so the convolution is centred");
  require(d.n_q == d.n_k, fn, ": dwc_weight needs n_q == n_k (got ", d.n_q, " and ", d.n_k, ")");
  for (int64_t i = 0; i < w.size(); ++i)
    require(std::isfinite(w.data[i]), fn, ": dwc_weight has a non-finite value at flat index ", i);
}

// out[b,h,i] += Σ_t w[h,t]·v[b,h,i+t−off] over 0 <= i+t−off < key_length(b).
template <class T>
void dwc_forward(TensorView<const T> v, TensorView<const T> w, const AttentionDims& d,
                 const KeyMask& mask, bool causal, T* out) {
  const int64_t K = w.dim(1), off = causal ? K - 1 : (K - 1) / 2, dv = d.value_dim, n = d.n_q;
  parallel_for(d.bh(), [&](int64_t bh, int) {
    const int64_t h = bh % d.heads, L = mask.key_length(bh / d.heads);
    for (int64_t i = 0; i < n; ++i) {
      T* o = out + (bh * n + i) * dv;
      for (int64_t t = 0; t < K; ++t) {
        const int64_t j = i + t - off;
        if (j < 0 || j >= L) continue;
        const T wt = w.data[h * K + t];
        const T* vr = v.row(bh, j);
        for (int64_t c = 0; c < dv; ++c) o[c] += wt * vr[c];
      }
    }
  });
}

// dv[b,h,j] += Σ_t w[h,t]·dout[b,h,j−t+off] (j < key_length); dw[h,t] = Σ_{b,i} dout_i·v_{i+t−off}.
template <class T>
void dwc_backward(TensorView<const T> v, TensorView<const T> w, const T* dout,
                  const AttentionDims& d, const KeyMask& mask, bool causal, T* dv, T* dw) {
  const int64_t K = w.dim(1), off = causal ? K - 1 : (K - 1) / 2, dvd = d.value_dim, n = d.n_q;
  parallel_for(d.bh(), [&](int64_t bh, int) {
    const int64_t h = bh % d.heads, L = mask.key_length(bh / d.heads);
    for (int64_t j = 0; j < L; ++j) {
      T* g = dv + (bh * n + j) * dvd;
      for (int64_t t = 0; t < K; ++t) {
        const int64_t i = j - t + off;
        if (i < 0 || i >= n) continue;
        const T wt = w.data[h * K + t];
        const T* go = dout + (bh * n + i) * dvd;
        for (int64_t c = 0; c < dvd; ++c) g[c] += wt * go[c];
      }
    }
  });
  parallel_for(d.heads, [&](int64_t h, int) {  // one task per head: no atomics
    for (int64_t t = 0; t < K; ++t) {
      T acc = 0;
      for (int64_t b = 0; b < d.batch; ++b) {
        const int64_t bh = b * d.heads + h, L = mask.key_length(b);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t j = i + t - off;
          if (j < 0 || j >= L) continue;
          acc += simd::dot(dout + (bh * n + i) * dvd, v.row(bh, j), static_cast<size_t>(dvd));
        }
      }
      dw[h * K + t] = acc;
    }
  });
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
  if (dwc_weight) check_dwc(fn, d, opts.causal, *dwc_weight);
  const KeyMask mask(d, mo);
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim});
  kernelized::forward<T>({q, k, v, d, &mask, &fmap, static_cast<T>(opts.eps)}, out.data());
  if (dwc_weight) dwc_forward(v, *dwc_weight, d, mask, opts.causal, out.data());
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
  if (dwc_weight) check_dwc(fn, d, opts.causal, *dwc_weight);
  const KeyMask mask(d, mo);
  KernelizedGrads<T> g{Tensor<T>(q.shape), Tensor<T>(k.shape), Tensor<T>(v.shape), Tensor<T>()};
  kernelized::backward<T>({q, k, v, d, &mask, &fmap, static_cast<T>(opts.eps)}, dout.data,
                          g.dq.data(), g.dk.data(), g.dv.data());
  if (dwc_weight) {
    g.d_dwc_weight = Tensor<T>(dwc_weight->shape);
    dwc_backward(v, *dwc_weight, dout.data, d, mask, opts.causal, g.dv.data(), g.d_dwc_weight.data());
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
  kernelized::forward<T>({q, k, v, d, &mask, &fmap, T(0)}, out.data());
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
  kernelized::backward<T>({q, k, v, d, &mask, &fmap, T(0)}, dout.data, g.dq.data(), g.dk.data(),
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
