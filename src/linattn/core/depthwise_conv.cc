#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/depthwise_conv.h"

#include <cmath>

#include "linattn/core/simd.h"
#include "linattn/core/parallel.h"

namespace linattn {

template <class T>
void check_depthwise_conv(const char* fn, const char* name, const AttentionDims& d, bool causal,
                          TensorView<const T> w) {
  require(w.rank() == 2 && w.dim(0) == d.heads && w.dim(1) >= 1, fn, ": ", name, " has shape ",
          shape_string(w.shape), "; expected [heads = ", d.heads, ", K]");
  require(causal || w.dim(1) % 2 == 1, fn, ": ", name,
          " needs an odd K when causal=false (got K = ", w.dim(1), ") so the convolution is centred");
  require(d.n_q == d.n_k, fn, ": ", name, " needs n_q == n_k (got ", d.n_q, " and ", d.n_k, ")");
  check_finite(fn, name, w);
}

template <class T>
void depthwise_conv_forward(TensorView<const T> v, TensorView<const T> w, const AttentionDims& d,
                            const KeyMask& mask, bool causal, T* out) {
  const int64_t K = w.dim(1), off = causal ? K - 1 : (K - 1) / 2, dv = d.value_dim, n = d.n_q;
  parallel_for(d.bh(), [&](int64_t bh) {
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

template <class T>
void depthwise_conv_backward(TensorView<const T> v, TensorView<const T> w, const T* dout,
                             const AttentionDims& d, const KeyMask& mask, bool causal, T* dv, T* dw) {
  const int64_t K = w.dim(1), off = causal ? K - 1 : (K - 1) / 2, dvd = d.value_dim, n = d.n_q;
  parallel_for(d.bh(), [&](int64_t bh) {
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
  parallel_for(d.heads, [&](int64_t h) {  // one task per head: no atomics
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

#define LINATTN_INSTANTIATE(T)                                                                    \
  template void check_depthwise_conv<T>(const char*, const char*, const AttentionDims&, bool,     \
                                        TensorView<const T>);                                     \
  template void depthwise_conv_forward<T>(TensorView<const T>, TensorView<const T>,               \
                                          const AttentionDims&, const KeyMask&, bool, T*);        \
  template void depthwise_conv_backward<T>(TensorView<const T>, TensorView<const T>, const T*,    \
                                           const AttentionDims&, const KeyMask&, bool, T*, T*);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
